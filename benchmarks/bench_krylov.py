"""Benchmark `krylovjax.krylov` against the ways a user would otherwise write it.

Four ways of building the Krylov matrix X = [x0, A x0, ..., A^(d-1) x0] of shape
(n, d) are compared, all jitted, on the CPU in float32:

- `krylovjax`: `krylovjax.krylov(A, x0, d)` with its defaults (the scan, and the
  rule that serves forward and reverse mode, whose reverse pass is the chunked
  hand-written adjoint);
- `kj_vjp`: the same reverse pass as a `jax.custom_vjp` (`adjoint="custom_vjp"`);
- `scan`: a plain `lax.scan` that returns the stacked vectors, `x0` concatenated in
  front, differentiated by JAX's own rules;
- `unrolled`: a Python loop over `d - 1` products, `jnp.stack`-ed at the end;
- `concat`: a Python loop that grows the matrix by `jnp.concatenate` of one column
  per step.

For each method and size (n, d) the script measures, for the forward pass and for
`jax.grad` of `loss(A, x0) = sum(X * W)` (a fixed random `W`; gradient with respect
to both `A` and `x0`): the run time (median over interleaved rounds after a warm-up
call, each call ended by `block_until_ready`), the compile time (wall time of
`lower` + `compile`) and XLA's compiled memory (`memory_analysis()`: temporaries,
outputs, arguments).

Run `python benchmarks/bench_krylov.py` (a few minutes on 2 cores) or
`python benchmarks/bench_krylov.py --quick` (a smoke run, under 30 s). Results
go to `--out` (default `benchmarks/out/krylov`, git-ignored): `results.json` (every
raw number and the machine), `results.md` (tables of ratios) and
`grad_time_memory_vs_d.png`.
The machine may be shared and noisy: read the ratios, measured side by side in one
run, rather than the absolute times.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import sparse as jsparse  # noqa: E402

import krylovjax  # noqa: E402

METHODS = ("krylovjax", "kj_vjp", "scan", "unrolled", "concat")
# The unrolled loop and concatenate growth trace d separate operations, and XLA's
# compile time grows faster than linearly in d (at n = 8 on a loaded 2-core machine:
# grad of `unrolled` compiled in 3.6 s at d = 100 and 12 s at d = 200; grad of
# `concat` in 18 s at d = 100 and 195 s at d = 200). Past these depths they are
# skipped.
PEER_MAX_D = {"unrolled": 200, "concat": 100}
SKIPPED = "skipped (d too large to compile in reasonable time)"

FULL = {
    "sizes": [(3, 10), (64, 50), (512, 200), (32, 5000), (1024, 100)],
    "scaling_n": 8,
    "scaling_ds": (10, 10000),
    "compile_repeats": 3,
    "plot_n": 64,
    "plot_ds": [10, 20, 50, 100, 200, 500, 1000, 2000],
    "target_time_s": 0.3,
    "min_repeats": 5,
    "max_repeats": 200,
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
    "target_time_s": 0.02,
    "min_repeats": 3,
    "max_repeats": 10,
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


def krylov_krylovjax(A, x0, d):
    return krylovjax.krylov(A, x0, d)


def krylov_kj_vjp(A, x0, d):
    return krylovjax.krylov(A, x0, d, adjoint="custom_vjp")


def krylov_scan(A, x0, d):
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
    "krylovjax": krylov_krylovjax,
    "kj_vjp": krylov_kj_vjp,
    "scan": krylov_scan,
    "unrolled": krylov_unrolled,
    "concat": krylov_concat,
}


def make_functions(method: str, d: int) -> tuple[Callable, Callable]:
    """Fresh (forward, grad) functions, so that no trace or compile cache is hit."""
    build = BUILDERS[method]

    def forward(A, x0):
        return build(A, x0, d)

    def loss(A, x0, W):
        return jnp.sum(build(A, x0, d) * W)

    grad = jax.grad(loss, argnums=(0, 1))
    return forward, grad


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


def compile_fn(fn: Callable, args) -> tuple[object, float]:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def memory(compiled) -> dict[str, int | None]:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {"temp_bytes": None, "output_bytes": None, "argument_bytes": None}
    return {
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "argument_bytes": int(analysis.argument_size_in_bytes),
    }


def call_time(compiled, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def time_interleaved(entries: list[dict], config) -> None:
    """Time every compiled function of one size in interleaved rounds.

    Each round calls every function `inner` times (its own `inner`, so that one
    batch takes about a millisecond or more) and records the mean time per call.
    Interleaving means that a burst of load from elsewhere on the machine hits all
    methods alike, so the ratios between them stay meaningful.
    """
    for e in entries:
        call_time(e["compiled"], e["args"])  # warm-up
        once = min(call_time(e["compiled"], e["args"]) for _ in range(3))
        e["inner"] = max(1, min(100, int(1e-3 / max(once, 1e-7))))
        e["times"] = []
        e["once"] = once
    per_round = sum(e["once"] * e["inner"] for e in entries)
    rounds = int(config["target_time_s"] * len(entries) / max(per_round, 1e-7))
    rounds = min(max(rounds, config["min_repeats"]), config["max_repeats"])
    for _ in range(rounds):
        for e in entries:
            total = sum(call_time(e["compiled"], e["args"]) for _ in range(e["inner"]))
            e["times"].append(total / e["inner"])


def measure_size(
    methods: list[str], n: int, d: int, config, b: int | None = None
) -> dict[str, dict]:
    A, x0, W = problem(n, d, b)
    results, entries = {}, []
    for method in methods:
        forward, grad = make_functions(method, d)
        result = {"method": method, "n": n, "d": d, "b": b}
        for name, fn, args in (
            ("forward", forward, (A, x0)),
            ("grad", grad, (A, x0, W)),
        ):
            compiled, compile_s = compile_fn(fn, args)
            result[name] = {"compile_s": compile_s, **memory(compiled)}
            result[name]["output"] = jax.tree.map(np.asarray, compiled(*args))
            entries.append({"compiled": compiled, "args": args, "into": result[name]})
        results[method] = result
    time_interleaved(entries, config)
    for e in entries:
        e["into"].update(
            median_s=statistics.median(e["times"]),
            min_s=min(e["times"]),
            rounds=len(e["times"]),
            calls_per_round=e["inner"],
        )
    return results


def check_agreement(results: list[dict], tag: str = "") -> dict[str, float]:
    """Largest relative difference of each method's outputs from plain `scan`'s."""
    ref = {
        (r["n"], r["d"]): r
        for r in results
        if r["method"] == "scan" and "skipped" not in r
    }
    errors = {}
    for r in results:
        base = ref.get((r["n"], r["d"]))
        if base is None or r["method"] == "scan" or "skipped" in r:
            continue
        worst = 0.0
        for name in ("forward", "grad"):
            for a, b in zip(
                jax.tree.leaves(r[name]["output"]),
                jax.tree.leaves(base[name]["output"]),
                strict=True,
            ):
                scale = max(float(np.max(np.abs(b))), 1e-30)
                worst = max(worst, float(np.max(np.abs(a - b))) / scale)
        errors[f"{r['method']} n={r['n']} d={r['d']}{tag}"] = worst
    return errors


def strip_outputs(results: list[dict]) -> list[dict]:
    for r in results:
        for name in ("forward", "grad"):
            r[name].pop("output", None)
    return results


def run_sizes(sizes, config, cache, log) -> list[dict]:
    results = []
    for n, d in sizes:
        methods = [m for m in METHODS if d <= PEER_MAX_D.get(m, d)]
        if (methods[0], n, d) not in cache:
            for method, r in measure_size(methods, n, d, config).items():
                cache[(method, n, d)] = r
                log(
                    f"  {method:>9} n={n:<5} d={d:<5} "
                    f"fwd {r['forward']['median_s'] * 1e3:9.3f} ms  "
                    f"grad {r['grad']['median_s'] * 1e3:9.3f} ms  "
                    f"compile grad {r['grad']['compile_s']:6.2f} s"
                )
        for method in METHODS:
            if method in methods:
                results.append(cache[(method, n, d)])
            else:
                results.append({"method": method, "n": n, "d": d, "skipped": SKIPPED})
    return results


def run_block_sizes(sizes, config, log) -> list[dict]:
    """krylovjax against plain scan for a block x0 of shape (n, b)."""
    results = []
    for n, d, b in sizes:
        methods = ["krylovjax", "kj_vjp", "scan"]
        for method, r in measure_size(methods, n, d, config, b).items():
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
            entries = []
            row = {"n": n, "d": d, "b": b, "kind": kind, "loss": loss_name}
            for method in ("krylovjax", "scan"):
                build = BUILDERS[method]

                def f(A, x0, W, build=build, loss=loss, d=d, make=make):
                    return loss(build(make(A), x0, d), W)

                compiled, _ = compile_fn(jax.grad(f, argnums=(0, 1)), (A, x0, W))
                row[method] = memory(compiled)["temp_bytes"]
                entries.append({"compiled": compiled, "args": (A, x0, W), "into": {}})
            time_interleaved(entries, config)
            row["time_ratio"] = statistics.median(
                entries[0]["times"]
            ) / statistics.median(entries[1]["times"])
            vector = 4 * n * (b or 1)
            row["extra_vectors"] = (row["krylovjax"] - row["scan"]) / vector
            log(
                f"  {loss_name:>16} {kind:>8} n={n:<4} d={d:<5} b={b} temp "
                f"{row['krylovjax'] / 1024:.0f} vs {row['scan'] / 1024:.0f} KiB "
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
        entries = []
        for method in ("scan", "doubling"):

            def f(A, x0, W, method=method, d=d):
                return jnp.sum(krylovjax.krylov(A, x0, d, method=method) * W)

            compiled, _ = compile_fn(jax.value_and_grad(f, argnums=(0, 1)), (A, x0, W))
            entries.append({"compiled": compiled, "args": (A, x0, W), "into": {}})
        time_interleaved(entries, config)
        scan_s, doubling_s = (statistics.median(e["times"]) for e in entries)
        results.append({"n": n, "d": d, "scan_s": scan_s, "doubling_s": doubling_s})
        log(f"  n={n} d={d} value+grad: scan / doubling {scan_s / doubling_s:.2f}")
    return results


def grad_compile_time(method: str, n: int, d: int, repeats: int) -> dict:
    A, x0, W = problem(n, d)
    times, temp = [], None
    for _ in range(repeats):
        _, grad = make_functions(method, d)
        compiled, seconds = compile_fn(grad, (A, x0, W))
        times.append(seconds)
        temp = memory(compiled)["temp_bytes"]
    return {
        "method": method,
        "n": n,
        "d": d,
        "compile_s": statistics.median(times),
        "compile_all_s": times,
        "temp_bytes": temp,
    }


def machine_info() -> dict:
    device = jax.devices()[0]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "krylovjax": krylovjax.__version__,
        "git_commit": commit,
        "backend": jax.default_backend(),
        "device": str(device),
        "device_kind": device.device_kind,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "dtype": "float32",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# Reporting.


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.3g}"


def _kib(x):
    return "-" if x is None else f"{x / 1024:.1f}"


def markdown(report: dict) -> str:
    lines = [
        "# krylovjax benchmark",
        "",
        f"Machine: {report['machine']['device']} ({report['machine']['backend']}), "
        f"{report['machine']['cpu_count']} CPUs, jax {report['machine']['jax']}, "
        f"float32, commit `{report['machine']['git_commit']}`. "
        f"Mode: {report['mode']}; total run time {report['total_s']:.0f} s.",
        "",
        "Loss: `sum(X * W)`, gradient with respect to `A` and `x0`. Times are medians "
        "of repeated jitted calls; memory is XLA's compiled temporary allocation.",
        "",
        "## Ratios (measured side by side)",
        "",
        "| n | d | kj grad / scan grad | kj grad / kj fwd | scan grad / scan fwd "
        "| kj grad temp / scan grad temp | kj grad / unrolled grad "
        "| kj grad / concat grad | kj_vjp grad / scan grad "
        "| kj_vjp grad temp / scan grad temp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {
        (r["method"], r["n"], r["d"]): r for r in report["sizes"] if "skipped" not in r
    }

    def get(method, n, d, name, field):
        r = by_key.get((method, n, d))
        return None if r is None else r[name][field]

    for n, d in report["config"]["sizes"]:
        kj_g = get("krylovjax", n, d, "grad", "median_s")
        kj_f = get("krylovjax", n, d, "forward", "median_s")
        sc_g = get("scan", n, d, "grad", "median_s")
        sc_f = get("scan", n, d, "forward", "median_s")
        un_g = get("unrolled", n, d, "grad", "median_s")
        co_g = get("concat", n, d, "grad", "median_s")
        kj_m = get("krylovjax", n, d, "grad", "temp_bytes")
        sc_m = get("scan", n, d, "grad", "temp_bytes")
        jv_g = get("kj_vjp", n, d, "grad", "median_s")
        jv_m = get("kj_vjp", n, d, "grad", "temp_bytes")
        lines.append(
            f"| {n} | {d} | {_fmt(_ratio(kj_g, sc_g))} | {_fmt(_ratio(kj_g, kj_f))} "
            f"| {_fmt(_ratio(sc_g, sc_f))} | {_fmt(_ratio(kj_m, sc_m))} "
            f"| {_fmt(_ratio(kj_g, un_g))} | {_fmt(_ratio(kj_g, co_g))} "
            f"| {_fmt(_ratio(jv_g, sc_g))} | {_fmt(_ratio(jv_m, sc_m))} |"
        )
    lines += [
        "",
        "## Block x0",
        "",
        "`x0` of shape `(n, b)`, `X` of shape `(n, d, b)`; unrolled and concat are "
        "not run at these depths.",
        "",
        "| n | d | b | kj grad / scan grad | kj grad temp / scan grad temp "
        "| kj_vjp grad / scan grad | kj grad ms | scan grad ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    blocks = {(r["method"], r["n"], r["d"], r["b"]): r for r in report["blocks"]}
    for n, d, b in report["config"]["block_sizes"]:
        kj, sc, jv = (
            blocks[(m, n, d, b)]["grad"] for m in ("krylovjax", "scan", "kj_vjp")
        )
        lines.append(
            f"| {n} | {d} | {b} | {_fmt(_ratio(kj['median_s'], sc['median_s']))} "
            f"| {_fmt(_ratio(kj['temp_bytes'], sc['temp_bytes']))} "
            f"| {_fmt(_ratio(jv['median_s'], sc['median_s']))} "
            f"| {_ms(kj['median_s'])} | {_ms(sc['median_s'])} |"
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
        "| A | n | d | b | loss | kj temp KiB | scan temp KiB | extra vectors "
        "| temp ratio | time ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["losses"]:
        lines.append(
            f"| {r['kind']} | {r['n']} | {r['d']} | {r['b'] or '-'} | {r['loss']} "
            f"| {_kib(r['krylovjax'])} | {_kib(r['scan'])} "
            f"| {r['extra_vectors']:+.0f} "
            f"| {_fmt(_ratio(r['krylovjax'], r['scan']))} | {_fmt(r['time_ratio'])} |"
        )
    lines += [
        "",
        "## What the default gives up against doubling",
        "",
        "The default method is the scan, which never overflows where the vectors do "
        'not. `method="doubling"` (opt-in) is faster at long d and small n; value '
        "and gradient of `sum(X * W)`:",
        "",
        "| n | d | scan ms | doubling ms | scan / doubling |",
        "|---|---|---|---|---|",
    ]
    for r in report["doubling"]:
        lines.append(
            f"| {r['n']} | {r['d']} | {_ms(r['scan_s'])} | {_ms(r['doubling_s'])} "
            f"| {_fmt(_ratio(r['scan_s'], r['doubling_s']))} |"
        )
    scaling = report["compile_scaling"]
    lo, hi = scaling["points"]
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
        "| method | n | d | fwd ms | grad ms | fwd compile s | grad compile s "
        "| fwd temp KiB | grad temp KiB | grad output KiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["sizes"]:
        if "skipped" in r:
            lines.append(
                f"| {r['method']} | {r['n']} | {r['d']} | {r['skipped']} | | | | | | |"
            )
            continue
        f, g = r["forward"], r["grad"]
        lines.append(
            f"| {r['method']} | {r['n']} | {r['d']} | {_ms(f['median_s'])} "
            f"| {_ms(g['median_s'])} | {f['compile_s']:.3f} | {g['compile_s']:.3f} "
            f"| {_kib(f['temp_bytes'])} | {_kib(g['temp_bytes'])} "
            f"| {_kib(g['output_bytes'])} |"
        )
    lines += [
        "",
        "## Against d at fixed n "
        f"(n = {report['config']['plot_n']}; the data of the figure)",
        "",
        "Compile time of `grad` in s; `grad` time in ms; `grad` temporary memory in "
        "KiB. `-`: skipped (d too large to compile in reasonable time).",
        "",
        "| d | "
        + " | ".join(f"{m} compile s" for m in METHODS)
        + " | "
        + " | ".join(f"{m} grad ms" for m in METHODS)
        + " | "
        + " | ".join(f"{m} temp KiB" for m in METHODS)
        + " |",
        "|---|" + "---|" * (3 * len(METHODS)),
    ]
    grid = {(r["method"], r["d"]): r for r in report["plot"] if "skipped" not in r}
    for d in report["config"]["plot_ds"]:
        rows = [grid.get((m, d)) for m in METHODS]
        cells = [_fmt(r and r["grad"]["compile_s"], ".3f") for r in rows]
        cells += [_ms(r and r["grad"]["median_s"]) for r in rows]
        cells += [_kib(r and r["grad"]["temp_bytes"]) for r in rows]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
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

    n = report["config"]["plot_n"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in METHODS:
        rows = sorted(
            (r for r in report["plot"] if r["method"] == method and "skipped" not in r),
            key=lambda r: r["d"],
        )
        if not rows:
            continue
        ds = [r["d"] for r in rows]
        ax_t.plot(ds, [r["grad"]["median_s"] * 1e3 for r in rows], "o-", label=method)
        ax_m.plot(
            ds, [r["grad"]["temp_bytes"] / 1024 for r in rows], "o-", label=method
        )
    for ax, ylabel in ((ax_t, "grad time [ms]"), (ax_m, "grad temp memory [KiB]")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("d")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"jax.grad of sum(X * W), n = {n}, float32 CPU "
        f"(unrolled up to d = {PEER_MAX_D['unrolled']}, "
        f"concat up to d = {PEER_MAX_D['concat']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

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

    strip_outputs(list(cache.values()) + blocks)
    report = {
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "config": {**config, "peer_max_d": PEER_MAX_D},
        "sizes": sizes,
        "plot": plot_rows,
        "blocks": blocks,
        "losses": losses,
        "doubling": doubling,
        "compile_scaling": scaling,
        "agreement": agreement,
        "total_s": time.perf_counter() - start,
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(report))
    if not args.no_plot:
        plot(report, args.out / "grad_time_memory_vs_d.png")
    print(markdown(report))
    log(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
