"""Benchmark `krylov(method=...)`: "scan" against "doubling" against "auto".

Three measurements, each written to `--out` (default `benchmarks/out/methods`,
git-ignored) as JSON and markdown, plus a plot of the timing ratios:

1. Time of `jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))` with
   `loss(A, x0) = sum(krylov(A, x0, d, method=m) * W)`, for a dense random `A`
   (spectral radius 0.9) and `x0` of shape `(n,)` (or `(n, b)` with `--block b`),
   over a grid of `n` and `d`, in `--dtype` (float32 by default). The methods are
   timed side by side in one run, interleaved, and the median of the repeats is
   reported, so the ratios are meaningful on a shared machine even when the
   absolute times are not. The loss
   takes the real part, so complex dtypes are timed the same way.
2. Accuracy: the largest column-wise relative error of the float32 Krylov matrix
   (and of the float32 gradient of `x0`) against a float64 reference, for random
   `A` with spectral radius 0.9 and 1.1 and a non-normal `A`, for both methods.
3. Memory: XLA's compiled memory analysis of `jit(grad(loss))` for both methods.

Run `python benchmarks/bench_methods.py` (about ten minutes on two CPU cores) or
`python benchmarks/bench_methods.py --quick` (a smaller grid, fewer repeats). The
thresholds of `method="auto"` come from runs of the timing alone per dtype, e.g.
`python benchmarks/bench_methods.py --dtype complex64 --skip-accuracy --ns 4 16 64
--ds 128 1024 --out benchmarks/out/focus_complex64` (the exact commands are in
`benchmarks/README.md`, "How `auto` chooses"). `--render JSON`
rewrites the markdown and plot beside an existing `methods.json` without measuring.
"""

import argparse
import json
import pathlib
import platform
import shlex
import sys

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np

import krylovjax

METHODS = ("scan", "doubling", "auto")
NS = (4, 16, 64, 256, 1024)
DS = (16, 128, 1024, 4096)
QUICK_NS = (4, 16, 64, 256)
QUICK_DS = (16, 128, 1024, 4096)
# Sizes not run on a CPU, with the reason; listed in the output tables.
SKIPPED = {
    (1024, 4096): "too long on 2 CPU cores (several seconds per call for each method)",
    (4096, 1024): "GPU-only size (an n^3 log d doubling at n=4096 is minutes on CPU)",
}


def random_matrix(rng, n, radius, dtype=np.float64):
    """A Gaussian matrix rescaled to the given spectral radius."""
    A = rng.standard_normal((n, n))
    A *= radius / np.max(np.abs(np.linalg.eigvals(A)))
    return A.astype(dtype)


def nonnormal_matrix(rng, n, radius, coupling=1.0):
    """Upper-triangular, eigenvalues of modulus <= radius, strong off-diagonal."""
    eig = radius * rng.uniform(0.5, 1.0, n)
    upper = np.triu(rng.standard_normal((n, n)), 1) * coupling / np.sqrt(n)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return Q @ (np.diag(eig) + upper) @ Q.T


def make_step(method, d):
    def loss(A, x0, W):
        # The real part makes the loss real for complex dtypes too.
        return jnp.sum(jnp.real(krylovjax.krylov(A, x0, d, method=method) * W))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def time_grid(ns, ds, repeats, dtype, budget, block=None):
    """The methods side by side at each (n, d), interleaved: `repeats` rounds, or
    fewer (at least 3) where they would take more than `budget` seconds, each
    calling every method as often as the fastest takes about 20 ms."""
    rows = []
    for n in ns:
        for d in ds:
            if (n, d) in SKIPPED:
                rows.append({"n": n, "d": d, "skipped": SKIPPED[(n, d)]})
                print(f"n={n:5d} d={d:5d} skipped: {SKIPPED[(n, d)]}", flush=True)
                continue
            rng = np.random.default_rng(n * 7919 + d)
            A = jnp.asarray(random_matrix(rng, n, 0.9), dtype)
            b = () if block is None else (block,)
            x0 = jnp.asarray(rng.standard_normal((n, *b)), dtype)
            W = jnp.asarray(rng.standard_normal((n, d, *b)), dtype)
            calls = [h.ready(make_step(m, d), (A, x0, W)) for m in METHODS]
            timed = h.time_interleaved(
                calls,
                target_s=budget / len(METHODS),
                min_rounds=min(3, repeats),
                max_rounds=repeats,
                batch_s=0.02,
                max_batch=10_000,
                shared_batch=True,
            )
            med = {m: t["median_s"] for m, t in zip(METHODS, timed, strict=True)}
            chosen = krylovjax.auto_method(A, x0, d)
            best = min(med["scan"], med["doubling"])
            row = {
                "n": n,
                "d": d,
                "repeats": timed[0]["rounds"],
                "number": timed[0]["calls_per_round"],
                **{f"{m}_s": med[m] for m in METHODS},
                "scan_over_doubling": med["scan"] / med["doubling"],
                "auto_over_best": med["auto"] / best,
                "auto_choice": chosen,
                "choice_over_best": med[chosen] / best,
            }
            rows.append(row)
            print(
                f"n={n:5d} d={d:5d}  scan {med['scan'] * 1e3:9.3f} ms  doubling "
                f"{med['doubling'] * 1e3:9.3f} ms  auto {med['auto'] * 1e3:9.3f} ms "
                f"({chosen})  scan/doubling {row['scan_over_doubling']:7.2f}  "
                f"auto/best {row['auto_over_best']:5.2f}  "
                f"choice/best {row['choice_over_best']:5.2f}",
                flush=True,
            )
    return rows


def _column_error(X, ref):
    """Largest relative error over columns whose reference is float32-representable."""
    X = np.asarray(X, np.float64)
    ref = np.asarray(ref, np.float64)
    norm = np.linalg.norm(ref, axis=0)
    keep = (norm > 1e-30) & (norm < 1e30)
    err = np.linalg.norm(X - ref, axis=0)[keep] / norm[keep]
    err = np.where(np.isfinite(err), err, np.inf)
    return float(np.max(err)), int(np.sum(keep))


def _vector_error(x, ref):
    """Relative error, or None when the reference is not float32-representable."""
    norm = np.linalg.norm(ref)
    if not 1e-30 < norm < 1e30:
        return None
    err = np.linalg.norm(np.asarray(x, np.float64) - ref) / norm
    return float(err) if np.isfinite(err) else float("inf")


def _fmt(x):
    return "n/a" if x is None else f"{x:.2e}"


def _loss_of_x0(A, x0, W, d, method):
    return jnp.sum(krylovjax.krylov(A, x0, d, method=method) * W)


def accuracy(ns, ds):
    rows = []
    cases = [("radius 0.9", 0.9), ("radius 1.1", 1.1), ("non-normal", None)]
    for n in ns:
        for d in ds:
            for name, radius in cases:
                rng = np.random.default_rng(1000 * n + d)
                if radius is None:
                    A64 = nonnormal_matrix(rng, n, 0.9, coupling=2.0)
                else:
                    A64 = random_matrix(rng, n, radius)
                x64 = rng.standard_normal(n)
                W64 = rng.standard_normal((n, d))
                with jax.enable_x64(True):
                    A, x, W = map(jnp.asarray, (A64, x64, W64))
                    ref = krylovjax.krylov(A, x, d, method="scan")
                    ref_g = jax.grad(_loss_of_x0, argnums=1)(A, x, W, d, "scan")
                    ref, ref_g = np.asarray(ref), np.asarray(ref_g)
                A32, x32, W32 = (jnp.asarray(a, jnp.float32) for a in (A64, x64, W64))
                row = {"case": name, "n": n, "d": d}
                for m in ("scan", "doubling"):
                    X = krylovjax.krylov(A32, x32, d, method=m)
                    g = jax.grad(_loss_of_x0, argnums=1)(A32, x32, W32, d, m)
                    err, cols = _column_error(X, ref)
                    gerr = _vector_error(g, ref_g)
                    row[f"{m}_err"] = err
                    row[f"{m}_grad_err"] = gerr
                    row["columns"] = cols
                row["err_ratio"] = h.ratio(row["doubling_err"], row["scan_err"])
                row["grad_err_ratio"] = h.ratio(
                    row["doubling_grad_err"], row["scan_grad_err"]
                )
                rows.append(row)
                print(
                    f"{name:11s} n={n:4d} d={d:5d} cols={cols:5d}  values: scan "
                    f"{_fmt(row['scan_err'])} doubling {_fmt(row['doubling_err'])} "
                    f"(x{_fmt(row['err_ratio'])})  grad x0: scan "
                    f"{_fmt(row['scan_grad_err'])} doubling "
                    f"{_fmt(row['doubling_grad_err'])} "
                    f"(x{_fmt(row['grad_err_ratio'])})",
                    flush=True,
                )
    return rows


def memory(sizes):
    rows = []
    for n, d in sizes:
        A = jax.ShapeDtypeStruct((n, n), jnp.float32)
        x0 = jax.ShapeDtypeStruct((n,), jnp.float32)
        W = jax.ShapeDtypeStruct((n, d), jnp.float32)
        row = {"n": n, "d": d, "nd_bytes": 4 * n * d, "nn_bytes": 4 * n * n}
        for m in ("scan", "doubling"):

            def loss(A, x0, W, m=m, d=d):
                return jnp.sum(krylovjax.krylov(A, x0, d, method=m) * W)

            compiled, _ = h.compile_timed(jax.grad(loss, argnums=(0, 1)), (A, x0, W))
            row[f"{m}_temp_bytes"] = h.memory(compiled)["temp_bytes"]
        rows.append(row)
        print(
            f"memory n={n:5d} d={d:5d}: temp scan {row['scan_temp_bytes']:,} B, "
            f"doubling {row['doubling_temp_bytes']:,} B (n*d*4 = {row['nd_bytes']:,} "
            f"B, n*n*4 = {row['nn_bytes']:,} B)",
            flush=True,
        )
    return rows


ERRORS = ("scan_err", "doubling_err", "err_ratio")
ERRORS += ("scan_grad_err", "doubling_grad_err", "grad_err_ratio")


def markdown(result):
    block = result.get("block")
    x0_shape = "`(n,)`" if block is None else f"`(n, {block})`"
    rows = []
    for r in result["timing"]:
        if "skipped" in r:
            rows.append([r["n"], r["d"], f"skipped: {r['skipped']}", *[""] * 5])
            continue
        chosen = r[f"{r['auto_choice']}_s"] / min(r["scan_s"], r["doubling_s"])
        times = [f"{r[f'{m}_s'] * 1e3:.3f}" for m in METHODS]
        times[-1] += f" ({r['auto_choice']})"
        ratios = (r["scan_over_doubling"], r["auto_over_best"], chosen)
        rows.append([r["n"], r["d"], *times, *(f"{x:.2f}" for x in ratios)])
    lines = [
        "# `krylov(method=...)`: scan vs doubling vs auto",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result.get('machine', platform.machine())}, {result['device']}, "
        f"JAX {result['jax']}, backend {result['backend']}.",
        "",
        f"## Forward + gradient time ({result.get('dtype', 'float32')}, median of "
        "repeats, milliseconds)",
        "",
        "`jit(value_and_grad(sum(krylov(A, x0, d) * W)))` with respect to `A` and "
        f"`x0`; `x0` of shape {x0_shape}. `auto / best` is auto's own time over the "
        "faster method's; where auto picks that method it runs the same program, so "
        "this column then shows the timing noise between two identical programs. "
        "`choice / best` is the time of the method auto picks, from the scan and "
        "doubling columns, over the faster one: 1.00 where auto picks the faster.",
        "",
        *h.table(
            "n | d | scan | doubling | auto (choice) | scan / doubling | auto / best "
            "| choice / best",
            rows,
            "rrrrlrrr",
        ),
        "",
        "## Accuracy (float32 against a float64 reference)",
        "",
        "Largest column-wise relative error $\\|x_i - x_i^{ref}\\| / \\|x_i^{ref}\\|$ "
        "over the columns whose reference norm lies in $(10^{-30}, 10^{30})$, and the "
        "relative error of the gradient of `x0` of `sum(X * W)` (n/a where the "
        "reference gradient overflows float32). Non-normal: upper triangular with "
        "eigenvalues in [0.45, 0.9] and off-diagonal entries of size 2/sqrt(n), "
        "rotated; max_k ||A^k|| is about 10^3 for n = 16 and 10^6 for n = 64.",
        "",
        *h.table(
            "case | n | d | columns | scan | doubling | ratio | grad scan "
            "| grad doubling | ratio",
            [
                [r["case"], r["n"], r["d"], r["columns"]] + [_fmt(r[k]) for k in ERRORS]
                for r in result["accuracy"]
            ],
            "lrrrrrrrrr",
        ),
        "",
        "## Memory of `jit(grad(loss))` (XLA compiled memory analysis, temp bytes)",
        "",
        *h.table(
            "n | d | scan | doubling | 4 n d | 4 n^2",
            [
                [r["n"], r["d"]]
                + [f"{r[k]:,}" for k in ("scan_temp_bytes", "doubling_temp_bytes")]
                + [f"{r[k]:,}" for k in ("nd_bytes", "nn_bytes")]
                for r in result["memory"]
            ],
            "rrrrrr",
        ),
    ]
    return "\n".join(lines) + "\n"


def plot(path, result):
    timing, dtype = result["timing"], result.get("dtype", "float32")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in timing if "skipped" not in r]
    for n in sorted({r["n"] for r in rows}):
        sub = [r for r in rows if r["n"] == n]
        ax.plot(
            [r["d"] for r in sub],
            [r["scan_over_doubling"] for r in sub],
            marker="o",
            label=f"n = {n}",
        )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("d (number of vectors)")
    ax.set_ylabel("time(scan) / time(doubling)")
    backend = result["backend"].upper()
    block = "" if result.get("block") is None else f", x0 (n, {result['block']})"
    ax.set_title(f"forward + gradient, {backend} {dtype}{block} (> 1: doubling faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller grid")
    parser.add_argument(
        "--out",
        default=pathlib.Path(__file__).parent / "out" / "methods",
        help="output folder (default: benchmarks/out/methods, git-ignored)",
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds per grid point (about)"
    )
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--ns", type=int, nargs="+", help="override the grid's n")
    parser.add_argument("--ds", type=int, nargs="+", help="override the grid's d")
    parser.add_argument(
        "--block", type=int, default=None, help="time a block x0 of shape (n, BLOCK)"
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="only rewrite the markdown and plot beside an existing methods.json",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "complex64", "complex128"),
        help="dtype of the timing grid (accuracy and memory always use float32)",
    )
    args = parser.parse_args()
    if args.render:
        json_path = pathlib.Path(args.render)
        result = json.loads(json_path.read_text())
        (json_path.parent / "methods.md").write_text(markdown(result))
        plot(json_path.parent / "methods.png", result)
        print(f"rewrote {json_path.parent}/methods.md, methods.png")
        return
    if args.dtype in ("float64", "complex128"):
        jax.config.update("jax_enable_x64", True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = map(shlex.quote, sys.argv[1:])
    command = " ".join(["python benchmarks/bench_methods.py", *argv])
    ns, ds = (QUICK_NS, QUICK_DS) if args.quick else (NS, DS)
    ns, ds = args.ns or ns, args.ds or ds
    repeats = args.repeats or (5 if args.quick else 9)
    budget = args.budget or (6.0 if args.quick else 20.0)

    timing = time_grid(ns, ds, repeats, jnp.dtype(args.dtype), budget, args.block)
    if args.skip_accuracy:
        acc = []
    else:
        acc_ds = (256, 4096) if args.quick else (256, 1024, 4096)
        acc = accuracy((16, 64), acc_ds)
    mem = memory([(64, 4096), (256, 1024), (256, 4096)])

    result = {
        "command": command,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "machine": platform.machine(),
        "dtype": args.dtype,
        "block": args.block,
        "timing": timing,
        "accuracy": acc,
        "memory": mem,
    }
    h.write_results(out, result, markdown(result), stem="methods")
    plot(out / "methods.png", result)
    print(f"wrote {out}/methods.json, methods.md, methods.png")


if __name__ == "__main__":
    main()
