"""Benchmark `trace_funm`'s estimators on a Gaussian-process log-determinant.

$\\log\\det(K + \\sigma^2 I)$ with $K_{ij} = \\exp(-|x_i - x_j|^2 / (2 \\ell^2))$, the
points uniform in the unit square, float64 on the CPU, Lanczos depth `d` for every
estimator. Measured:

- **Statistics** (at `--n-stats`, where many keys are affordable): for each
  estimator and budget, the relative error of the value against the dense
  `slogdet` over `--seeds` keys, its 95th percentile, and the variance of the
  gradient in the lengthscale. For Hutchinson, whose terms are independent, the
  mean and standard deviation of single-probe estimates over many keys give its
  bias and the number of probes the 95% bound needs (bias + 1.96 sigma / sqrt(m)
  <= 1e-3 |log det|, the normal approximation); the deflated estimators are run
  at each budget of a grid and the cheapest that meets the bound is reported.
- **At n = `--n-big`** (dense and matrix-free: a callable that computes the
  kernel's rows in blocks, never storing K): a few keys of the best deflated
  budget and of single-probe Hutchinson, the same statistics, and the time of a
  value and gradient (lengthscale) call of each, side by side.
- **Competitors** at the statistics size and the time at n-big: GPyTorch's
  stochastic Lanczos log-det at its defaults (`pip install -e ".[bench-gpytorch]"`)
  and matfree's Monte Carlo log-det integrand and XTrace on Lanczos actions of
  log(A) (`".[bench-matfree]"`); a missing one reads "not installed".

`--spectral-density` times a smoothed spectral density at 101 points, a `jax.vmap`
over the points of `trace_funm`, against one point (docs/bases.md, "Spectral
densities").

Run `python benchmarks/bench_trace.py` (long: the statistics alone took about 40
minutes on a shared 2-core machine, mostly the many keys of the gradient runs) or
`--quick` (a smoke run of small sizes, still several minutes, mostly compiling).
Results go to `--out` (default `benchmarks/out/trace`): `results.json` and
`results.md`.
"""

import argparse
import math
from pathlib import Path

import _harness as h
import numpy as np

h.cpu_by_default()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import krylovjax  # noqa: E402

jax.config.update("jax_enable_x64", True)

FULL = {
    "n_stats": 2000,
    "n_big": 10000,
    "seeds": 60,
    "big_seeds": 3,
    "single_probes": 200,
    "grid": [(8, 1), (8, 2), (16, 2)],
    "timing": {"target_s": 0.0, "min_rounds": 1, "max_rounds": 1},
}
QUICK = {
    "n_stats": 300,
    "n_big": 600,
    "seeds": 10,
    "big_seeds": 2,
    "single_probes": 20,
    "grid": [(4, 1)],
    "timing": {"target_s": 0.0, "min_rounds": 1, "max_rounds": 1},
}
TARGET = 1e-3
ROW_BLOCK = 1000


def points(n, dim, seed=0):
    return jax.random.uniform(jax.random.key(seed), (n, dim), jnp.float64)


def dense(X, lengthscale, noise):
    sq = jnp.sum((X[:, None] - X[None]) ** 2, axis=-1)
    return jnp.exp(-sq / (2 * lengthscale**2)) + noise * jnp.eye(X.shape[0])


def matrix_free(X, lengthscale, noise):
    """$v \\mapsto (K + \\sigma^2 I) v$, the kernel's rows computed in blocks."""
    n = X.shape[0]
    block = min(ROW_BLOCK, n)
    rows = X.reshape(n // block, block, X.shape[1])

    def mv(v):
        def part(Xb):
            sq = jnp.sum((Xb[:, None] - X[None]) ** 2, axis=-1)
            return jnp.exp(-sq / (2 * lengthscale**2)) @ v

        return jax.lax.map(part, rows).reshape(n) + noise * v

    return mv


def exact(X, lengthscale, noise):
    """The log-determinant and its lengthscale derivative, dense, in NumPy."""
    Xn = np.asarray(X)
    sq = ((Xn[:, None] - Xn[None]) ** 2).sum(-1)
    K = np.exp(-sq / (2 * lengthscale**2))
    A = K + noise * np.eye(len(Xn))
    value = np.linalg.slogdet(A)[1]
    dK = K * sq / lengthscale**3
    grad = np.sum(np.linalg.inv(A) * dK)
    return float(value), float(grad)


def estimator_fn(X, noise, d, m, estimator, b=None, free=False, q=None):
    """Value and lengthscale gradient of one estimate, vmapped over keys."""
    options = {} if b is None else {"num_sketch": b}
    if q is not None:
        options["deflated_blocks"] = q

    def one(lengthscale, key):
        A = (matrix_free if free else dense)(X, lengthscale, noise)
        return krylovjax.trace_funm(
            jnp.log,
            A,
            key,
            d,
            num_probes=m,
            estimator=estimator,
            like=X[:, 0] if free else None,
            **options,
        )

    return jax.jit(jax.vmap(jax.value_and_grad(one), in_axes=(None, 0)))


def run_keys(fn, lengthscale, keys, chunk):
    values, grads = [], []
    for i in range(0, len(keys), chunk):
        v, g = fn(lengthscale, keys[i : i + chunk])
        values.append(np.asarray(v))
        grads.append(np.asarray(g))
    return np.concatenate(values), np.concatenate(grads)


def summary(values, grads, value, grad, products):
    rel = np.abs(values - value) / abs(value)
    return {
        "products": products,
        "q95_rel_error": float(np.quantile(rel, 0.95)),
        "mean_rel_error": float(np.mean(values - value) / abs(value)),
        "grad_var": float(np.var(grads, ddof=1)),
        "grad_mean": float(np.mean(grads)),
        "grad_exact": grad,
    }


def hutchinson_needed(values, grads, value, d):
    """From single-probe estimates: bias, sigma, probes for the 95% bound."""
    bias = float(np.mean(values) - value)
    sigma = float(np.std(values, ddof=1))
    room = TARGET * abs(value) - abs(bias)
    probes = math.ceil((1.96 * sigma / room) ** 2) if room > 0 else None
    return {
        "bias_rel": bias / abs(value),
        "sigma_rel": sigma / abs(value),
        "grad_var_one_probe": float(np.var(grads, ddof=1)),
        "probes_needed": probes,
        "products_needed": None if probes is None else probes * d,
    }


def statistics(cfg, dim, lengthscale, noise, d, log):
    n = cfg["n_stats"]
    X = points(n, dim)
    value, grad = exact(X, lengthscale, noise)
    keys = jax.random.split(jax.random.key(42), cfg["single_probes"])
    v, g = run_keys(estimator_fn(X, noise, d, 1, "hutchinson"), lengthscale, keys, 50)
    hutch = hutchinson_needed(v, g, value, d)
    log(f"hutchinson at n={n}: {hutch}")
    keys = jax.random.split(jax.random.key(7), cfg["seeds"])
    rows = []
    for b, rest in cfg["grid"]:
        m = b + rest
        for name, est, sketch in (
            ("krylov-aware", "krylov-aware", b),
            ("hutch++", "hutch++", m // 3),
            ("hutchinson", "hutchinson", None),
        ):
            if name != "krylov-aware" and (b, rest) != cfg["grid"][-1]:
                continue
            fn = estimator_fn(X, noise, d, m, est, sketch)
            v, g = run_keys(fn, lengthscale, keys, 10)
            r = summary(v, g, value, grad, m * d) | {
                "estimator": name,
                "num_probes": m,
                "num_sketch": sketch,
            }
            rows.append(r)
            log(f"{name} m={m} sketch={sketch}: {r}")
    return {"n": n, "exact": value, "exact_grad": grad, "hutch": hutch, "rows": rows}


def best(rows):
    """The cheapest krylov-aware budget that meets the target, else the best."""
    ka = [r for r in rows if r["estimator"] == "krylov-aware"]
    ok = [r for r in ka if r["q95_rel_error"] <= TARGET]
    return (
        min(ok, key=lambda r: r["products"])
        if ok
        else min(ka, key=lambda r: r["q95_rel_error"])
    )


def big(cfg, dim, lengthscale, noise, d, choice, log, kinds=(False, True)):
    """The chosen budget and single-probe Hutchinson at n-big, dense and
    matrix-free: statistics over a few keys, and the time of one call."""
    n = cfg["n_big"]
    X = points(n, dim)
    value, _ = exact(X, lengthscale, noise)
    log(f"exact at n={n}: {value}")
    m, b = choice["num_probes"], choice["num_sketch"]
    q = choice.get("deflated_blocks")
    keys = jax.random.split(jax.random.key(3), cfg["big_seeds"])
    out = {"n": n, "exact": value}
    for free in kinds:
        kind = "matrix-free" if free else "dense"
        ka = estimator_fn(X, noise, d, m, "krylov-aware", b, free, q)
        # The matrix-free operator recomputes the kernel at every product: its
        # statistics are those of the dense one (same keys, same estimates to
        # rounding), so it runs one key, for the agreement and the time.
        v, g = run_keys(ka, lengthscale, keys[:1] if free else keys, 1)
        rel = np.abs(v - value) / abs(value)
        if not free:
            hk = jax.random.split(jax.random.key(9), 8 * cfg["big_seeds"])
            hv, hg = run_keys(
                estimator_fn(X, noise, d, 1, "hutchinson"), lengthscale, hk, 8
            )
            hutch = hutchinson_needed(hv, hg, value, d)
        timing = h.measure(
            {
                "krylov-aware": (ka, (lengthscale, keys[:1])),
                "hutchinson": (
                    estimator_fn(X, noise, d, m, "hutchinson", None, free),
                    (lengthscale, keys[:1]),
                ),
            },
            **cfg["timing"],
        )
        out[kind] = {
            "values": v.tolist(),
            "max_rel_error": float(np.max(rel)),
            "q95_rel_error": float(np.quantile(rel, 0.95)),
            "ka_grad_var": float(np.var(g, ddof=1)) if len(g) > 1 else None,
            # Hutchinson's at the same products: the single-probe variance / m.
            "hutch_grad_var_same_budget": hutch["grad_var_one_probe"] / m,
            "hutch": hutch,
            "time_s": {k: t["median_s"] for k, t in timing.items()},
        }
        log(f"{kind} at n={n}: {out[kind]}")
    return out


def gpytorch_case(X, lengthscale, noise, seeds, value, grad, time_n=None):
    """GPyTorch's `logdet` at its defaults: statistics over torch seeds."""
    try:
        import gpytorch  # noqa: F401
        import torch
        from linear_operator.operators import DenseLinearOperator
    except ImportError:
        return h.NOT_INSTALLED
    import time

    torch.set_default_dtype(torch.float64)

    def call(Xt, seed):
        torch.manual_seed(seed)
        ell = torch.tensor(lengthscale, requires_grad=True)
        sq = torch.cdist(Xt, Xt) ** 2
        K = torch.exp(-sq / (2 * ell**2))
        op = DenseLinearOperator(K).add_diagonal(torch.tensor(noise))
        out = op.logdet()
        (g,) = torch.autograd.grad(out, ell)
        return float(out), float(g)

    Xt = torch.tensor(np.asarray(X))
    res = np.array([call(Xt, s) for s in range(seeds)])
    rel = np.abs(res[:, 0] - value) / abs(value)
    out = {
        "q95_rel_error": float(np.quantile(rel, 0.95)),
        "mean_rel_error": float(np.mean(res[:, 0] - value) / abs(value)),
        "grad_var": float(np.var(res[:, 1], ddof=1)),
        "grad_mean": float(np.mean(res[:, 1])),
        "grad_exact": grad,
    }
    if time_n is not None:
        Xb = torch.tensor(np.asarray(points(time_n, X.shape[1])))
        call(Xb, 0)
        start = time.perf_counter()
        call(Xb, 1)
        out["time_s_big"] = time.perf_counter() - start
    return out


def matfree_case(X, lengthscale, noise, d, m, seeds, value, grad):
    """matfree's Monte Carlo log-det (Rademacher, Lanczos quadrature) and XTrace
    on Lanczos actions of log(A), at m probes each."""
    try:
        from matfree import decomp, funm, stochtrace
    except ImportError:
        return h.NOT_INSTALLED

    def matvec(v, ell):
        return dense(X, ell, noise) @ v

    x_like = X[:, 0]
    integrand = funm.monte_carlo_funm_sym_logdet(decomp.tridiag_sym(d))
    sampler = stochtrace.sampler_signs(x_like, num=m)
    mc = stochtrace.estimator_monte_carlo(integrand, sampler)
    action = funm.funm_lanczos_sym(
        funm.dense_funm_sym_eigh(jnp.log), decomp.tridiag_sym(d)
    )
    xt = stochtrace.leave_one_out_xtrace()
    xsampler = stochtrace.sampler_normal(x_like, num=m)
    xtrace = stochtrace.estimator_leave_one_out(xt, xsampler)

    def log_mv(v, ell):
        return action(matvec, v, ell)

    out = {}
    for name, est in (("matfree_mc", mc), ("matfree_xtrace", xtrace)):
        mv = matvec if name == "matfree_mc" else log_mv
        try:
            fn = jax.jit(
                jax.vmap(
                    jax.value_and_grad(lambda ell, k, est=est, mv=mv: est(mv, k, ell)),
                    in_axes=(None, 0),
                )
            )
            keys = jax.random.split(jax.random.key(11), seeds)
            v, g = run_keys(fn, lengthscale, keys, 10)
            out[name] = summary(v, g, value, grad, m * d)
        except Exception as error:  # a competitor that cannot run this
            out[name] = h.failure(error)
    return out


def markdown(report):
    s = report["stats"]
    lines = [
        f"# trace_funm estimators: log det(K + s^2 I), {report['problem']}",
        "",
        f"Statistics at n = {s['n']} over {report['seeds']} keys (d = "
        f"{report['d']}); exact log det {s['exact']:.6g}, exact d/dl "
        f"{s['exact_grad']:.6g}.",
        "",
    ]
    hu = s["hutch"]
    lines += [
        f"Hutchinson (single-probe estimates): bias {hu['bias_rel']:.2e} relative, "
        f"sigma {hu['sigma_rel']:.2e} relative per probe; probes for 95% <= "
        f"{TARGET:g}: {hu['probes_needed']} ({hu['products_needed']} products).",
        "",
    ]
    rows = [
        (
            r["estimator"],
            r["num_probes"],
            "-" if r["num_sketch"] is None else r["num_sketch"],
            r["products"],
            h.fmt(r["q95_rel_error"], ".2e"),
            h.fmt(r["mean_rel_error"], ".1e"),
            h.fmt(r["grad_var"], ".3g"),
        )
        for r in s["rows"]
    ]
    lines += h.table(
        "estimator | num_probes | num_sketch | products | q95 rel. error | "
        "mean rel. error | grad variance",
        rows,
        "lrrrrrr",
    )
    c = report["choice"]
    hp = hu["products_needed"]
    lines += [
        "",
        f"Best krylov-aware budget: num_probes={c['num_probes']}, num_sketch="
        f"{c['num_sketch']}: {c['products']} products, q95 {c['q95_rel_error']:.2e}"
        f" (target {TARGET:g}: {'met' if c['q95_rel_error'] <= TARGET else 'MISSED'})"
        f"; Hutchinson needs {hp} products: ratio "
        f"{h.fmt(None if hp is None else hp / c['products'], '.1f')}x (target 10x).",
    ]
    same = [
        r
        for r in s["rows"]
        if r["num_probes"] == c["num_probes"] and r["estimator"] == "hutchinson"
    ][0]
    lines += [
        f"Gradient variance at that budget: Hutchinson {same['grad_var']:.3g}, "
        f"krylov-aware {c['grad_var']:.3g}: ratio "
        f"{same['grad_var'] / max(c['grad_var'], 1e-300):.1f}x (target 5x).",
        "",
    ]
    b = report["big"]
    lines += [f"## n = {b['n']} (exact log det {b['exact']:.6g})", ""]
    rows = []
    for kind in ("dense", "matrix-free"):
        r = b[kind]
        rows.append(
            (
                kind,
                h.fmt(r["max_rel_error"], ".2e"),
                h.fmt(r["hutch"]["sigma_rel"], ".2e"),
                r["hutch"]["products_needed"],
                h.ms(r["time_s"]["krylov-aware"]),
                h.ms(r["time_s"]["hutchinson"]),
            )
        )
    lines += h.table(
        "operator | krylov-aware max rel. error | Hutchinson sigma/probe (rel.) | "
        "Hutchinson products needed | krylov-aware value+grad (ms) | "
        "Hutchinson same budget (ms)",
        rows,
        "lrrrrr",
    )
    lines += ["", "## Competitors (statistics size)", ""]
    rows = []
    for name, r in report["competitors"].items():
        if isinstance(r, str):
            rows.append((name, r, "", "", "", ""))
            continue
        rows.append(
            (
                name,
                h.fmt(r["q95_rel_error"], ".2e"),
                h.fmt(r["mean_rel_error"], ".1e"),
                h.fmt(r["grad_var"], ".3g"),
                h.fmt(r.get("grad_mean"), ".4g"),
                h.ms(r.get("time_s_big")),
            )
        )
    lines += h.table(
        "method | q95 rel. error | mean rel. error | grad variance | grad mean | "
        "time at n-big (ms)",
        rows,
        "lrrrrr",
    )
    return "\n".join(lines) + "\n"


def big_only(cfg, args, log):
    """The n-big part and matfree's estimators, without the statistics."""
    ell, noise, d = args.lengthscale, args.noise, args.d
    m, b = args.big_only
    X = points(cfg["n_stats"], args.dim)
    value, grad = exact(X, ell, noise)
    report = {
        "problem": f"{args.dim}-D uniform points, lengthscale {ell}, noise {noise}",
        "d": d,
        "choice": {
            "num_probes": m,
            "num_sketch": b,
            "deflated_blocks": args.deflated_blocks,
        },
        "machine": h.machine_info("jax", "jaxlib", "gpytorch", "matfree"),
    }
    if not args.dense_only:
        report["competitors"] = matfree_case(
            X, ell, noise, d, m, cfg["seeds"], value, grad
        )
        log(f"matfree: {report['competitors']}")
    kinds = (False,) if args.dense_only else (False, True)
    report["big"] = big(cfg, args.dim, ell, noise, d, report["choice"], log, kinds)
    stem = f"big_{m}_{b}" + ("_dense" if args.dense_only else "")
    if args.deflated_blocks is not None:
        stem += f"_q{args.deflated_blocks}"
    h.write_results(args.out, report, f"{report}\n", stem=stem)
    print(report)


def deflation_sweep(cfg, args, log):
    """How much of the block Krylov space to deflate (`deflated_blocks`).

    On the kernel at the statistics size: the 95th percentile of the relative
    error and the lengthscale gradient's variance over `--seeds` keys for each
    `deflated_blocks`, at the budget `--sweep-budget`, beside Hutchinson's with
    as many probes. Then the price: the quadrature bias of the deflated trace,
    $\operatorname{tr}(E^\top f(\mathcal T) E) - \operatorname{tr}(Q^\top f(A) Q)$,
    computed against a dense $f(A)$ for one sketch (the library's own block
    Krylov basis), over the standard deviation of one remainder probe (sphere
    probes on the complement of $Q$), for spectra without decay ($n = 1000$) and
    for the kernel."""
    # The library's block Krylov basis, for the bias only.
    from krylovjax import _trace
    from krylovjax._operator import DenseOperator

    ell, noise, d = args.lengthscale, args.noise, args.d
    m, b = args.sweep_budget
    qs = sorted({d - d // 2, (2 * d) // 3, d - 5, d - 2, d - 1, d})
    X = points(cfg["n_stats"], args.dim)
    value, grad = exact(X, ell, noise)
    keys = jax.random.split(jax.random.key(7), cfg["seeds"])
    rows = []
    for q in qs:
        fn = estimator_fn(X, noise, d, m, "krylov-aware", b, q=q)
        v, g = run_keys(fn, ell, keys, 10)
        rows.append(summary(v, g, value, grad, m * d) | {"deflated_blocks": q})
        log(f"deflated_blocks={q}: {rows[-1]}")
    v, g = run_keys(estimator_fn(X, noise, d, m, "hutchinson"), ell, keys, 10)
    hutch = summary(v, g, value, grad, m * d)
    log(f"hutchinson m={m}: {hutch}")

    n = 1000
    rng = np.random.default_rng(0)
    U, _ = np.linalg.qr(rng.standard_normal((n, n)))
    spectra = {
        "log, eigenvalues uniform in [1, 100]": (np.linspace(1, 100, n), np.log),
        "exp, eigenvalues uniform in [0, 20]": (np.linspace(0, 20, n), np.exp),
        "1/x, eigenvalues geometric in [1e-3, 1]": (
            np.geomspace(1e-3, 1, n),
            lambda x: 1 / x,
        ),
    }
    matrices = {k: ((U * lam) @ U.T, f) for k, (lam, f) in spectra.items()}
    matrices[f"log, the kernel (n = {cfg['n_stats']})"] = (
        np.asarray(dense(X, ell, noise)),
        np.log,
    )
    bias = {}
    for name, (A, f) in matrices.items():
        size = A.shape[0]
        lam, V = np.linalg.eigh(A)
        fA = (V * f(lam)) @ V.T
        omega = jax.random.normal(jax.random.key(3), (b, size), jnp.float64)
        basis, products = jax.jit(
            lambda A, omega: _trace._block_krylov(DenseOperator(A), omega, d)
        )(jnp.asarray(A), omega)
        basis = np.asarray(basis)
        T = basis @ np.asarray(products).T
        mu, W = np.linalg.eigh((T + T.T) / 2)
        fT = (W * f(mu)) @ W.T
        bias[name] = []
        for q in qs:
            k = q * b
            Q = basis[:k]
            err = np.trace(fT[:k, :k]) - np.trace(Q @ fA @ Q.T)
            # f(A) on the complement of Q, in an orthonormal basis of it, and
            # the variance of one probe uniform on that sphere (trace_funm's
            # docstring): 2 r / (r + 2) (|M|_F^2 - tr(M)^2 / r), r = size - k.
            rest = np.linalg.qr(Q.T, mode="complete")[0][:, k:]
            M = rest.T @ fA @ rest
            r = size - k
            square = np.sum(M * M) - np.trace(M) ** 2 / r
            sd = np.sqrt(2 * r / (r + 2) * square)
            bias[name].append({"deflated_blocks": q, "bias": err, "probe_sd": sd})
        log(f"bias, {name}: {bias[name]}")
    report = {
        "problem": f"{args.dim}-D uniform points, lengthscale {ell}, noise {noise}",
        "d": d,
        "budget": {"num_probes": m, "num_sketch": b},
        "n": cfg["n_stats"],
        "seeds": cfg["seeds"],
        "exact": value,
        "rows": rows,
        "hutchinson": hutch,
        "bias": bias,
        "machine": h.machine_info("jax", "jaxlib"),
    }
    lines = [
        f"log det(K + s^2 I) at n = {cfg['n_stats']}, num_probes = {m}, "
        f"num_sketch = {b}, d = {d}, {cfg['seeds']} keys:",
        "",
    ]
    lines += h.table(
        "deflated_blocks | q95 rel. error | mean rel. error | grad variance",
        [
            (
                r["deflated_blocks"],
                h.fmt(r["q95_rel_error"], ".2e"),
                h.fmt(r["mean_rel_error"], ".1e"),
                h.fmt(r["grad_var"], ".3g"),
            )
            for r in rows
        ]
        + [
            (
                f"Hutchinson, {m} probes",
                h.fmt(hutch["q95_rel_error"], ".2e"),
                h.fmt(hutch["mean_rel_error"], ".1e"),
                h.fmt(hutch["grad_var"], ".3g"),
            )
        ],
        "lrrr",
    )
    lines += [
        "",
        "Quadrature bias of the deflated trace over one remainder probe's "
        f"standard deviation (one sketch of {b} columns):",
        "",
    ]
    lines += h.table(
        "matrix | " + " | ".join(f"q = {q}" for q in qs),
        [
            (name,) + tuple(h.fmt(abs(c["bias"]) / c["probe_sd"], ".1e") for c in cells)
            for name, cells in bias.items()
        ],
        "l" + "r" * len(qs),
    )
    text = "\n".join(lines) + "\n"
    h.write_results(args.out, report, text, stem=f"deflation_{m}_{b}")
    print(text)


def spectral_density(args, log):
    """A smoothed spectral density phi(t) = tr g(t I - A) / n (g a Gaussian of
    width 0.1) at 101 points by `jax.vmap` over t of `trace_funm` (d = 60, 20
    probes), timed side by side with one point: the runs do not depend on t, so
    `vmap` shares them. A dense symmetric matrix, n = 2000 (`--quick`: 500), half
    its eigenvalues uniform in [0, 1] and half normal around 3 (spread 0.3)."""
    n = 500 if args.quick else 2000
    rng = np.random.default_rng(0)
    eigenvalues = np.concatenate(
        [rng.uniform(0, 1, n // 2), rng.normal(3, 0.3, n - n // 2)]
    )
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    A = jnp.asarray((Q * eigenvalues) @ Q.T)
    ts = jnp.linspace(-0.5, 4.5, 101)
    width, key = 0.1, jax.random.key(0)

    def g(x):
        return jnp.exp(-(x**2) / (2 * width**2)) / (np.sqrt(2 * np.pi) * width)

    def phi(A, t):
        return krylovjax.trace_funm(lambda x: g(t - x), A, key, 60, num_probes=20) / n

    fns = {
        "101 points": (lambda A: jax.vmap(lambda t: phi(A, t))(ts), (A,)),
        "1 point": (lambda A: phi(A, 1.0), (A,)),
    }
    log(f"spectral density at n = {n}: compiling and timing")
    results = h.measure(fns, outputs=True)
    exact = np.mean(np.asarray(g(np.asarray(ts)[:, None] - eigenvalues)), axis=1)
    error = float(np.max(np.abs(results["101 points"]["output"] - exact)))
    ms = {k: v["median_s"] * 1e3 for k, v in results.items()}
    report = {
        "n": n,
        "ms": ms,
        "largest_error": error,
        "peak": float(exact.max()),
        "machine": h.machine_info("jax", "jaxlib"),
    }
    text = (
        f"n = {n}: 101 points {ms['101 points']:.1f} ms, one point "
        f"{ms['1 point']:.1f} ms (ratio {ms['101 points'] / ms['1 point']:.2f}); "
        f"largest error {error:.3f}, density peak {exact.max():.2f}\n"
    )
    h.write_results(args.out, report, text, stem="spectral_density")
    print(text)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=h.REPO / "benchmarks/out/trace")
    parser.add_argument("--dim", type=int, default=2)
    parser.add_argument("--lengthscale", type=float, default=0.2)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--d", type=int, default=30)
    parser.add_argument(
        "--big-only",
        nargs=2,
        type=int,
        metavar=("NUM_PROBES", "NUM_SKETCH"),
        help="skip the statistics: run the n-big part with this Krylov-aware "
        "budget (the statistics' choice in docs/bases.md: 10 8) and matfree's "
        "estimators at the statistics size",
    )
    parser.add_argument(
        "--big-seeds",
        type=int,
        help="keys at n-big for the Krylov-aware budget (8 times as many single "
        "Hutchinson probes); default 3, too few for a 95th percentile",
    )
    parser.add_argument(
        "--deflated-blocks",
        type=int,
        help="with --big-only: trace_funm's deflated_blocks for the Krylov-aware "
        "budget (default: the library's, ceil(d / 2))",
    )
    parser.add_argument(
        "--deflation-sweep",
        action="store_true",
        help="only the sweep over deflated_blocks at the statistics size, and the "
        "quadrature bias it costs on spectra without decay",
    )
    parser.add_argument(
        "--sweep-budget",
        nargs=2,
        type=int,
        default=(4, 3),
        metavar=("NUM_PROBES", "NUM_SKETCH"),
        help="with --deflation-sweep: the Krylov-aware budget (default 4 3)",
    )
    parser.add_argument(
        "--dense-only",
        action="store_true",
        help="with --big-only: the dense operator only, and no competitors",
    )
    parser.add_argument(
        "--spectral-density",
        action="store_true",
        help="only the smoothed spectral density at 101 points against one point",
    )
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    if args.big_seeds is not None:
        cfg = cfg | {"big_seeds": args.big_seeds}
    log = h.Log()
    ell, noise, d = args.lengthscale, args.noise, args.d
    if args.big_only:
        big_only(cfg, args, log)
        return
    if args.deflation_sweep:
        deflation_sweep(cfg, args, log)
        return
    if args.spectral_density:
        spectral_density(args, log)
        return
    stats = statistics(cfg, args.dim, ell, noise, d, log)
    choice = best(stats["rows"])
    report = {
        "problem": f"{args.dim}-D uniform points, lengthscale {ell}, noise {noise}",
        "d": d,
        "seeds": cfg["seeds"],
        "stats": stats,
        "choice": choice,
        "machine": h.machine_info("jax", "jaxlib", "gpytorch", "matfree"),
    }
    X = points(cfg["n_stats"], args.dim)
    competitors = {
        "gpytorch (defaults)": gpytorch_case(
            X,
            ell,
            noise,
            cfg["seeds"],
            stats["exact"],
            stats["exact_grad"],
            time_n=cfg["n_big"],
        )
    }
    log(f"gpytorch: {competitors}")
    mf = matfree_case(
        X,
        ell,
        noise,
        d,
        choice["num_probes"],
        cfg["seeds"],
        stats["exact"],
        stats["exact_grad"],
    )
    competitors.update(mf if isinstance(mf, dict) else {"matfree": mf})
    log(f"matfree: {mf}")
    report["competitors"] = competitors
    report["big"] = big(cfg, args.dim, ell, noise, d, choice, log)
    text = markdown(report)
    h.write_results(args.out, report, text)
    print(text)


if __name__ == "__main__":
    main()
