"""Benchmark `krylov(basis=...)`: the three-term recurrence's rule against plain
autodiff through the same recurrence, and the cost of a basis over the monomials.

For a learnable `ThreeTerm` basis (dense `A`, float32, CPU): `jax.grad` of
`sum(X * W)` with respect to `A`, `x0` and the three coefficient arrays, by the
default rule (`krylovjax`) and by `adjoint="autodiff"` (`autodiff`: JAX's rules
through the same `lax.scan`), timed side by side, with XLA's compiled temporary
memory; the forward pass of a `Chebyshev` basis against the monomial default; and
the forward mode (`jax.jvp`) against the reverse pass for a callable `A` with
parameters (a closure over a dense matrix). Last, forward against reverse mode
on a matrix-free log-det: `trace_funm(jnp.log, ...)` of an RBF kernel matrix plus
noise, applied as a closure over the points, differentiated in the lengthscale and
the noise (the Lanczos rule's forward and reverse passes).

Run `python benchmarks/bench_bases.py` (about a minute on 2 cores) or `--quick`.
Results go to `--out` (default `benchmarks/out/bases`, git-ignored): `results.json`
and `results.md`; `--docs` also writes the table to `docs/benchmarks/bases.md`.
"""

import argparse
from pathlib import Path

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np

import krylovjax

FULL = {
    "sizes": [(512, 200, None), (256, 1024, 8), (32, 5000, None)],
    "logdet": (2000, 30, 16),
    "timing": {"target_s": 0.3, "min_rounds": 5, "max_rounds": 200},
}
QUICK = {
    "sizes": [(64, 50, None)],
    "logdet": (100, 8, 4),
    "timing": {"target_s": 0.02, "min_rounds": 3, "max_rounds": 5},
}


def problem(n, d, b, seed=0):
    rng = np.random.default_rng(seed)
    A = jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n) / 2, jnp.float32)
    shape = (n,) if b is None else (n, b)
    x0 = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    W = jnp.asarray(rng.standard_normal((n, d, *shape[1:])), jnp.float32)
    coefficients = tuple(jnp.full(d - 1, v, jnp.float32) for v in (1.0, 0.1, 0.2))
    return A, x0, W, coefficients


def grad_fn(d, adjoint):
    def loss(A, x0, W, coefficients):
        basis = krylovjax.ThreeTerm(*coefficients)
        X = krylovjax.krylov(A, x0, d, basis=basis, adjoint=adjoint)
        return jnp.sum(X * W)

    return jax.grad(loss, argnums=(0, 1, 3))


def run_size(n, d, b, timing):
    A, x0, W, coefficients = problem(n, d, b)
    args = (A, x0, W, coefficients)
    grads = h.measure(
        {
            adjoint: (grad_fn(d, adjoint), args)
            for adjoint in ("custom_jvp", "autodiff")
        },
        **timing,
    )
    basis = krylovjax.Chebyshev(-1.0, 1.0)
    forward = h.measure(
        {
            "chebyshev": (
                lambda A, x0: krylovjax.krylov(A, x0, d, basis=basis),
                (A, x0),
            ),
            "monomial": (lambda A, x0: krylovjax.krylov(A, x0, d), (A, x0)),
        },
        **timing,
    )

    # Forward mode against reverse mode, for a callable A with parameters.
    def logdet_like(A, x0):
        X = krylovjax.krylov(lambda v: A @ v, x0, d, basis=basis)
        return jnp.sum(X * W)

    tangent = jnp.ones_like(A)
    modes = h.measure(
        {
            "jvp": (
                lambda A, x0: jax.jvp(lambda A: logdet_like(A, x0), (A,), (tangent,)),
                (A, x0),
            ),
            "grad": (jax.grad(logdet_like), (A, x0)),
        },
        **timing,
    )
    vector = x0.size * 4
    return {
        "n": n,
        "d": d,
        "b": b,
        "grad_time_ratio": h.ratio(
            grads["custom_jvp"]["median_s"], grads["autodiff"]["median_s"]
        ),
        "grad_temp_vectors": {k: v["temp_bytes"] / vector for k, v in grads.items()},
        "grad_median_s": {k: v["median_s"] for k, v in grads.items()},
        "forward_time_ratio": h.ratio(
            forward["chebyshev"]["median_s"], forward["monomial"]["median_s"]
        ),
        "jvp_over_grad": h.ratio(modes["jvp"]["median_s"], modes["grad"]["median_s"]),
    }


def logdet_modes(n, d, num_probes, timing):
    """`jax.jvp` against `jax.grad` of a matrix-free stochastic log-det."""
    points = jax.random.normal(jax.random.key(1), (n, 3))
    key = jax.random.key(0)

    def logdet(lengthscale, noise):
        def mv(v):
            sq = jnp.sum((points[:, None] - points[None]) ** 2, -1)
            return jnp.exp(-sq / (2 * lengthscale**2)) @ v + noise * v

        return krylovjax.trace_funm(
            jnp.log, mv, key, d, num_probes=num_probes, like=points[:, 0]
        )

    args = (jnp.float32(1.0), jnp.float32(0.1))
    tangents = (jnp.float32(1.0), jnp.float32(0.0))
    modes = h.measure(
        {
            "value": (logdet, args),
            "jvp": (lambda *a: jax.jvp(logdet, a, tangents), args),
            "grad": (jax.grad(logdet, argnums=(0, 1)), args),
        },
        **timing,
    )
    median = {k: v["median_s"] for k, v in modes.items()}
    return {
        "n": n,
        "d": d,
        "num_probes": num_probes,
        "median_s": median,
        "jvp_over_grad": h.ratio(median["jvp"], median["grad"]),
    }


def markdown(report):
    m = report["machine"]
    rows = [
        (
            f"({r['n']}, {r['d']}{'' if r['b'] is None else ', b=' + str(r['b'])})",
            h.ms(r["grad_median_s"]["custom_jvp"]),
            h.ms(r["grad_median_s"]["autodiff"]),
            h.fmt(r["grad_time_ratio"]),
            h.fmt(r["grad_temp_vectors"]["custom_jvp"], ".0f"),
            h.fmt(r["grad_temp_vectors"]["autodiff"], ".0f"),
            h.fmt(r["forward_time_ratio"]),
            h.fmt(r["jvp_over_grad"]),
        )
        for r in report["sizes"]
    ]
    lines = h.table(
        "(n, d) | grad, rule (ms) | grad, autodiff (ms) | rule / autodiff | "
        "temp vectors, rule | temp vectors, autodiff | forward, Chebyshev / monomial | "
        "jvp / grad, callable A",
        rows,
        "lrrrrrrr",
    )
    note = (
        "\n`ThreeTerm` basis, gradient of `sum(X * W)` in `A`, `x0` and the "
        "coefficients; temporary memory in vectors of `x0`'s size (the dense "
        "gradient of `A` alone is n of them). "
        f"jax {m['versions']['jax']}, {m['backend']}, {m['cores']} cores, "
        f"{m['time']}.\n"
    )
    r = report["logdet"]
    t = r["median_s"]
    logdet = (
        f"\nMatrix-free log-det (`trace_funm(jnp.log, ...)` of an RBF kernel plus "
        f"noise as a closure, n = {r['n']}, d = {r['d']}, {r['num_probes']} probes, "
        f"derivative in the lengthscale and the noise): value {h.ms(t['value'])} ms, "
        f"jvp {h.ms(t['jvp'])} ms, grad {h.ms(t['grad'])} ms, "
        f"jvp / grad {h.fmt(r['jvp_over_grad'])}.\n"
    )
    return "\n".join(lines) + "\n" + note + logdet


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--out", default="benchmarks/out/bases")
    parser.add_argument("--docs", action="store_true", help="also write the docs table")
    args = parser.parse_args(argv)
    h.cpu_by_default()
    config = QUICK if args.quick else FULL
    log = h.Log()
    sizes = []
    for n, d, b in config["sizes"]:
        log(f"size ({n}, {d}, {b})")
        sizes.append(run_size(n, d, b, config["timing"]))
    log(f"log-det {config['logdet']}")
    logdet = logdet_modes(*config["logdet"], config["timing"])
    report = {"machine": h.machine_info(), "sizes": sizes, "logdet": logdet}
    text = markdown(report)
    h.write_results(Path(args.out), report, text)
    if args.docs:
        Path("docs/benchmarks/bases.md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
