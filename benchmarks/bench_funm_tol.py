"""`funm_action(tol=...)`: the depth it picks against a sweep, its true error, and
products and time against SciPy's `expm_multiply`.

Problems (float64):

- `exp(-tL) b` for the Laplacian $L$ of a 2-D grid graph (BCOO), $t = 1$ and
  $t = 10$; the exact result from the grid's Kronecker structure,
  $e^{-tL} = e^{-tL_1} \\otimes e^{-tL_1}$ with $L_1$ the path's Laplacian;
- `A^{-1/2} b` for an RBF kernel matrix plus noise (dense), exact by `eigh`.

For each tolerance, the sweep is the error of the Lanczos approximation at every
depth $k \\le d$, from one decomposition of depth $d$ (the approximation from $k$
vectors uses the leading $k$ columns and the leading block of $T$); "smallest" is
the first depth whose true relative error is below the tolerance. The row reports
the depth `funm_action(tol=...)` used, its ratio to the smallest, the true relative
error and the estimate, and the products with $A$: its depth, and those of
`scipy.sparse.linalg.expm_multiply` (which has no tolerance argument and works to
double precision), counted through a `LinearOperator` (its norm estimates
included). Times: the compiled `funm_action(tol=...)`, the fixed depth $d$ and the
fixed smallest depth, value and value + gradient, side by side in one run.

Run `python benchmarks/bench_funm_tol.py` (a few minutes on 2 cores; `--quick`
for a smoke run). It prints Markdown tables and writes them with the raw numbers to
`--out` (default `benchmarks/out/funm_tol/`, ignored by git).
"""

import argparse
import time
from pathlib import Path

import _harness as h

h.cpu_by_default()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402
import scipy.sparse  # noqa: E402
import scipy.sparse.linalg  # noqa: E402
from jax.experimental import sparse  # noqa: E402

import krylovjax  # noqa: E402

jax.config.update("jax_enable_x64", True)

TOLS = (1e-4, 1e-6, 1e-8, 1e-10)


def path_laplacian(m):
    main = np.full(m, 2.0)
    main[[0, -1]] = 1.0
    return np.diag(main) - np.diag(np.ones(m - 1), 1) - np.diag(np.ones(m - 1), -1)


def grid_problem(m, t, seed=0):
    L1 = path_laplacian(m)
    L = scipy.sparse.kronsum(scipy.sparse.csr_matrix(L1), scipy.sparse.csr_matrix(L1))
    L = L.tocoo()
    b = np.random.default_rng(seed).normal(size=m * m)
    E = scipy.linalg.expm(-t * L1)
    exact = (E @ b.reshape(m, m) @ E.T).reshape(-1)
    A = sparse.BCOO.from_scipy_sparse(L.tocsr()).sort_indices()
    return {
        "name": f"exp(-tL) b, {m}x{m} grid, t = {t:g}",
        "A": A,
        "scipy": L.tocsr(),
        "b": b,
        "exact": exact,
        "f": lambda x: jnp.exp(-t * x),
        "t": t,
    }


def kernel_problem(n, lengthscale=0.2, noise=1e-2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(size=(n, 2))
    sq = ((X[:, None] - X[None]) ** 2).sum(-1)
    K = np.exp(-sq / (2 * lengthscale**2)) + noise * np.eye(n)
    w, V = np.linalg.eigh(K)
    b = rng.normal(size=n)
    exact = V @ (w**-0.5 * (V.T @ b))
    return {
        "name": f"K^(-1/2) b, RBF n = {n}, l = {lengthscale:g}, noise {noise:g}",
        "A": jnp.asarray(K),
        "b": b,
        "exact": exact,
        "f": lambda x: x**-0.5,
        "cond": float(w[-1] / w[0]),
    }


def sweep(problem, d):
    """The true relative error of the Lanczos approximation at depths 1 .. d."""
    dec = krylovjax.lanczos(problem["A"], jnp.asarray(problem["b"]), d)
    Q, T = np.asarray(dec.basis), np.asarray(dec.matrix())
    f = problem["f"]
    exact = problem["exact"]
    errors = []
    for k in range(1, d + 1):
        lam, V = np.linalg.eigh(T[:k, :k])
        c = V @ (np.asarray(f(jnp.asarray(lam))) * V[0])
        y = float(dec.norm) * Q[:, :k] @ c
        errors.append(np.linalg.norm(y - exact) / np.linalg.norm(exact))
    return np.array(errors)


class Counting(scipy.sparse.linalg.LinearOperator):
    def __init__(self, A, scale):
        super().__init__(A.dtype, A.shape)
        self.A, self.scale, self.products = A, scale, 0

    def _matvec(self, x):
        self.products += 1 if x.ndim == 1 else x.shape[1]
        return self.scale * (self.A @ x)

    def _rmatvec(self, x):
        self.products += 1
        return self.scale * (self.A.T @ x)

    def _matmat(self, X):
        self.products += X.shape[1]
        return self.scale * (self.A @ X)

    def _adjoint(self):
        return self


def scipy_expm(problem):
    op = Counting(problem["scipy"], -problem["t"])
    trace = -problem["t"] * problem["scipy"].diagonal().sum()
    start = time.perf_counter()
    y = scipy.sparse.linalg.expm_multiply(op, problem["b"], traceA=trace)
    seconds = time.perf_counter() - start
    error = np.linalg.norm(y - problem["exact"]) / np.linalg.norm(problem["exact"])
    return {"products": op.products, "error": error, "seconds": seconds}


def run_problem(problem, d, tols, quick):
    errors = sweep(problem, d)
    A, b = problem["A"], jnp.asarray(problem["b"])
    f = problem["f"]
    w = jnp.asarray(np.random.default_rng(1).normal(size=b.shape))
    rows = []
    for tol in tols:
        below = np.nonzero(errors < tol)[0]
        smallest = int(below[0]) + 1 if below.size else None

        def with_tol(A, b, tol=tol):
            return krylovjax.funm_action(f, A, b, d, method="lanczos", tol=tol)

        y, info = jax.jit(with_tol)(A, b)
        exact = problem["exact"]
        true = float(np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact))
        estimate = float(info.error) / float(jnp.linalg.norm(y))
        record = {
            "tol": tol,
            "smallest": smallest,
            "depth": int(info.depth),
            "converged": bool(info.converged),
            "true_error": true,
            "estimate": estimate,
        }
        if not quick and smallest is not None:

            def fixed(A, b, k):
                return krylovjax.funm_action(f, A, b, k, method="lanczos")

            def loss_tol(A, b, tol=tol):
                return jnp.vdot(w, with_tol(A, b, tol)[0])

            def loss_fixed(A, b, k):
                return jnp.vdot(w, fixed(A, b, k))

            calls = [
                h.ready(jax.jit(with_tol), (A, b)),
                h.ready(jax.jit(lambda A, b: fixed(A, b, d)), (A, b)),
                h.ready(jax.jit(lambda A, b, k=smallest: fixed(A, b, k)), (A, b)),
                h.ready(
                    jax.jit(jax.value_and_grad(loss_tol, (0, 1), allow_int=True)),
                    (A, b),
                ),
                h.ready(
                    jax.jit(
                        jax.value_and_grad(
                            lambda A, b: loss_fixed(A, b, d), (0, 1), allow_int=True
                        )
                    ),
                    (A, b),
                ),
                h.ready(
                    jax.jit(
                        jax.value_and_grad(
                            lambda A, b, k=smallest: loss_fixed(A, b, k),
                            (0, 1),
                            allow_int=True,
                        )
                    ),
                    (A, b),
                ),
            ]
            times = [t["median_s"] for t in h.time_interleaved(calls)]
            record["times"] = dict(
                zip(
                    ["tol", "fixed_d", "fixed_smallest"]
                    + ["grad_tol", "grad_fixed_d", "grad_fixed_smallest"],
                    times,
                    strict=True,
                )
            )
        rows.append(record)
    return {"name": problem["name"], "d": d, "sweep": errors.tolist(), "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/funm_tol"))
    args = parser.parse_args()
    m, n_kernel = (30, 300) if args.quick else (100, 2000)
    tols = TOLS[1:2] if args.quick else TOLS
    problems = [
        (grid_problem(m, 1.0), 60),
        (grid_problem(m, 10.0), 120),
        (kernel_problem(n_kernel), 200),
    ]
    report = {"machine": h.machine_info("scipy"), "problems": []}
    lines = []
    for problem, d in problems:
        result = run_problem(problem, d, tols, args.quick)
        if "scipy" in problem:
            result["scipy"] = scipy_expm(problem)
        report["problems"].append(result)
        lines += [f"### {problem['name']} (d = {d})", ""]
        header = (
            "tol | smallest depth (sweep) | depth used | used / smallest | "
            "true error | estimate | converged"
        )
        body = []
        for r in result["rows"]:
            body.append(
                [
                    f"{r['tol']:g}",
                    r["smallest"],
                    r["depth"],
                    h.fmt(r["depth"] / r["smallest"] if r["smallest"] else None),
                    f"{r['true_error']:.1e}",
                    f"{r['estimate']:.1e}",
                    r["converged"],
                ]
            )
        lines += h.table(header, body, "rrrrrrl") + [""]
        if "scipy" in result:
            s = result["scipy"]
            lines += [
                f"SciPy `expm_multiply`: {s['products']} products (norm estimates "
                f"included), relative error {s['error']:.1e}, "
                f"{s['seconds'] * 1e3:.0f} ms.",
                "",
            ]
        timed = [r for r in result["rows"] if "times" in r]
        if timed:
            header = (
                "tol | tol / fixed d | tol / fixed smallest | grad: tol / fixed d | "
                "grad: tol / fixed smallest | tol (ms) | grad tol (ms)"
            )
            body = []
            for r in timed:
                t = r["times"]
                body.append(
                    [
                        f"{r['tol']:g}",
                        h.fmt(t["tol"] / t["fixed_d"]),
                        h.fmt(t["tol"] / t["fixed_smallest"]),
                        h.fmt(t["grad_tol"] / t["grad_fixed_d"]),
                        h.fmt(t["grad_tol"] / t["grad_fixed_smallest"]),
                        h.ms(t["tol"]),
                        h.ms(t["grad_tol"]),
                    ]
                )
            lines += h.table(header, body, "rrrrrrr") + [""]
    markdown = "\n".join(lines)
    print(markdown)
    h.write_results(args.out, report, markdown)


if __name__ == "__main__":
    main()
