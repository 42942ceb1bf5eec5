"""Arnoldi, Lanczos and f(A)b against matfree: gradient time and compiled memory.

For each problem, `jax.grad` of a loss that touches every output of the
decomposition (`sum(Q * W) + sum(H * V)` with fixed random weights, so that every
cotangent is non-zero) with respect to the matrix (the dense array, or the stored
values of a BCOO matrix) and the starting vector, for

- krylovjax: `krylovjax.arnoldi` / `krylovjax.lanczos` (default derivative rule);
- matfree: `matfree.decomp.hessenberg` / `tridiag_sym` (its custom VJP, the
  adjoint of Kraemer et al. 2024), with the matrix-vector product a user writes,
  `A @ v` (for BCOO this is JAX's own BCOO product);

and value-and-grad of `sum(f(A) b * w)` for `f = exp` by `krylovjax.funm_action`
and `matfree.funm.funm_lanczos_sym` / `funm_arnoldi`. Times are medians of
interleaved rounds in one run (ratios are what to read on a shared machine);
memory is XLA's compiled temporary memory, which is deterministic.

Each row also says whether forward mode and complex numbers work for the same
configuration (`capabilities`, on a small problem of the row's matrix kind):
forward mode if `jax.jvp` runs and agrees with JAX's autodiff of krylovjax's loop,
complex numbers if `jax.grad` with complex128 arrays runs and agrees with a central
difference of the implementation's own loss.

Run `pip install -e ".[bench,bench-matfree]"` then
`python benchmarks/bench_decompositions.py` (a few minutes on 2 cores; `--quick`
for a smoke run). It prints a Markdown table and writes it with the raw numbers to
`--out` (default `benchmarks/out/decompositions/`, ignored by git).
"""

import argparse
import functools
import itertools
from pathlib import Path

import _harness as h
import jax
import jax.numpy as jnp
from jax.experimental import sparse
from matfree import decomp, funm

import krylovjax


def dense_problem(n, dtype=jnp.float32):
    key_a, key_x = jax.random.split(jax.random.key(0))
    G = jax.random.normal(key_a, (n, n), dtype)
    A = (G + G.conj().T) / (2 * n) ** 0.5 / 2  # Hermitian, spectrum in about [-1, 1]
    x0 = jax.random.normal(key_x, (n,), dtype)
    return A, x0, lambda p: p, lambda v, p: p @ v


def sparse_problem(n, per_row=10, dtype=jnp.float32):
    key_i, key_v, key_x = jax.random.split(jax.random.key(1), 3)
    rows = jnp.repeat(jnp.arange(n), per_row // 2)
    cols = jax.random.randint(key_i, rows.shape, 0, n)
    values = jax.random.normal(key_v, rows.shape, dtype) / per_row**0.5 / 2
    # Hermitian (symmetric when real): each entry and its mirror image, conjugated,
    # sorted by rows. An entry on the diagonal is added to its own mirror image, so
    # its value is real.
    indices = jnp.concatenate([jnp.stack([rows, cols], 1), jnp.stack([cols, rows], 1)])
    values = jnp.concatenate([values, jnp.conj(values)])
    order = jnp.lexsort((indices[:, 1], indices[:, 0]))
    indices, values = indices[order], values[order]
    x0 = jax.random.normal(key_x, (n,), dtype)

    def bcoo(p):
        return sparse.BCOO((p, indices), shape=(n, n), indices_sorted=True)

    return values, x0, bcoo, lambda v, p: bcoo(p) @ v


def decomposition_losses(kind, d, reortho, problem):
    """{name: loss(p, x0)} for krylovjax and matfree, same weights."""
    params, x0, build, matvec = problem
    n = x0.shape[0]
    key_w, key_v = jax.random.split(jax.random.key(2))
    W = jax.random.normal(key_w, (n, d), jnp.float32)
    V = jax.random.normal(key_v, (d, d), jnp.float32)
    reorthogonalize = reortho == "full"
    if kind == "arnoldi":
        matfree_decomp = decomp.hessenberg(d, reortho=reortho)

        def ours(p, x0, adjoint="custom_jvp"):
            out = krylovjax.arnoldi(
                build(p), x0, d, reorthogonalize=reorthogonalize, adjoint=adjoint
            )
            return jnp.real(jnp.sum(out.basis * W) + jnp.sum(out.hessenberg * V))

    else:
        matfree_decomp = decomp.tridiag_sym(d, reortho=reortho)

        def ours(p, x0, adjoint="custom_jvp"):
            out = krylovjax.lanczos(
                build(p), x0, d, reorthogonalize=reorthogonalize, adjoint=adjoint
            )
            return jnp.real(jnp.sum(out.basis * W) + jnp.sum(out.matrix() * V))

    def theirs(p, x0):
        out = matfree_decomp(matvec, x0, p)
        # matfree stores the basis as (d, n) ("Q_tall" of the flattened vectors).
        Q = out.Q_tall if out.Q_tall.shape == (n, d) else out.Q_tall.T
        return jnp.real(jnp.sum(Q * W) + jnp.sum(out.J_small * V))

    return {
        "krylovjax": ours,
        "matfree": theirs,
        "reference": functools.partial(ours, adjoint="autodiff"),
    }


def funm_losses(kind, d, reortho, problem):
    params, x0, build, matvec = problem
    w = jax.random.normal(jax.random.key(3), x0.shape, jnp.float32)
    reorthogonalize = reortho == "full"
    if kind == "arnoldi":
        matfree_funm = funm.funm_arnoldi(
            funm.dense_funm_pade_exp(), decomp.hessenberg(d, reortho=reortho)
        )

        def ours(p, b, adjoint="custom_jvp"):
            fb = krylovjax.funm_action(
                jax.scipy.linalg.expm,
                build(p),
                b,
                d,
                method="arnoldi",
                reorthogonalize=reorthogonalize,
                adjoint=adjoint,
            )
            return jnp.real(jnp.sum(fb * w))

    else:
        matfree_funm = funm.funm_lanczos_sym(
            funm.dense_funm_sym_eigh(jnp.exp), decomp.tridiag_sym(d, reortho=reortho)
        )

        def ours(p, b, adjoint="custom_jvp"):
            fb = krylovjax.funm_action(
                jnp.exp,
                build(p),
                b,
                d,
                method="lanczos",
                reorthogonalize=reorthogonalize,
                adjoint=adjoint,
            )
            return jnp.real(jnp.sum(fb * w))

    def theirs(p, b):
        return jnp.real(jnp.sum(matfree_funm(matvec, b, p) * w))

    return {
        "krylovjax": ours,
        "matfree": theirs,
        "reference": functools.partial(ours, adjoint="autodiff"),
    }


def _forward(primals, f):
    tangents = tuple(
        jnp.sin(jnp.arange(x.size)).reshape(x.shape).astype(x.dtype) for x in primals
    )
    return jax.jit(lambda *p: jax.jvp(f, p, tangents)[1])(*primals)


# The sizes at which forward mode and complex numbers are checked (the timed sizes
# would only add minutes): the same matrix kind, method and re-orthogonalisation.
PROBE_SIZES = {"dense": (40, 8), "BCOO": (400, 8)}


def capabilities(matrix, kind, reortho, make):
    """Whether forward mode and complex numbers work for each implementation, on a
    small problem of the row's kind:

    - forward mode: `jax.jvp` (float32) runs and agrees to 1e-3 with JAX's own
      autodiff of krylovjax's loop (`adjoint="autodiff"`);
    - complex: `jax.grad` with complex128 arrays (a Hermitian matrix) runs and
      agrees to 1e-5 with a central difference of the implementation's own loss
      along a random complex direction of the matrix and the starting vector.
    """
    n, d = PROBE_SIZES[matrix]
    found = {}
    problem = dense_problem(n) if matrix == "dense" else sparse_problem(n)
    primals = problem[:2]
    losses = make(kind, d, reortho, problem)
    want = _forward(primals, losses["reference"])
    for name in ("krylovjax", "matfree"):
        try:
            got = _forward(primals, losses[name])
        except Exception as error:  # noqa: BLE001 (any failure means "no")
            found[name, "forward"] = f"no ({type(error).__name__})"
            continue
        err = h.largest_difference(got, want)
        found[name, "forward"] = "yes" if err < 1e-3 else f"no (error {err:.0e})"
    with jax.enable_x64(True):
        dtype = jnp.complex128
        problem = (
            dense_problem(n, dtype)
            if matrix == "dense"
            else sparse_problem(n, dtype=dtype)
        )
        p, x = problem[:2]
        losses = make(kind, d, reortho, problem)
        key_v, key_u = jax.random.split(jax.random.key(4))
        v = jax.random.normal(key_v, p.shape, dtype)
        u = jax.random.normal(key_u, x.shape, dtype)
        eps = 1e-6
        for name in ("krylovjax", "matfree"):
            loss = jax.jit(losses[name])
            try:
                g_p, g_x = jax.jit(jax.grad(losses[name], (0, 1)))(p, x)
            except Exception as error:  # noqa: BLE001 (any failure means "no")
                found[name, "complex"] = f"no ({type(error).__name__})"
                continue
            # JAX's gradient of a real loss in a complex argument is the conjugate
            # of the steepest-ascent direction: dL = Re(sum(direction * grad)).
            slope = jnp.real(jnp.sum(v * g_p) + jnp.sum(u * g_x))
            difference = (
                loss(p + eps * v, x + eps * u) - loss(p - eps * v, x - eps * u)
            ) / (2 * eps)
            err = float(jnp.abs(slope - difference) / jnp.abs(difference))
            found[name, "complex"] = "yes" if err < 1e-5 else f"no (error {err:.0e})"
    return found


def compile_times(n=1000, depths=(10, 1000)):
    """Seconds to compile `jax.grad` of each decomposition's loss (dense, `n`), at
    each depth in `depths`: flat in d, since every loop is a `lax.scan`."""
    problem = dense_problem(n)
    params, x0 = problem[0], problem[1]
    rows = []
    for kind in ("arnoldi", "lanczos"):
        for reortho in ("full", "none"):
            seconds = []
            for d in depths:
                loss = decomposition_losses(kind, d, reortho, problem)["krylovjax"]
                seconds.append(h.compile_timed(jax.grad(loss, (0, 1)), (params, x0))[1])
            rows.append((kind, reortho, seconds))
    return rows


def time_task(task, losses, args, timing):
    fns = {
        name: (
            jax.grad(loss, (0, 1)) if task == "grad" else jax.value_and_grad(loss),
            args,
        )
        for name, loss in losses.items()
        if name != "reference"
    }
    return h.measure(fns, **timing)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few runs")
    parser.add_argument(
        "--compile-only", action="store_true", help="only the compile times against d"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out" / "decomp"
    )
    args = parser.parse_args()
    h.cpu_by_default()
    if args.quick:
        timing = {"target_s": 0.05, "min_rounds": 3, "max_rounds": 5}
        sizes = [("dense", 200, 20), ("BCOO", 5000, 10)]
    else:
        timing = {"target_s": 0.5, "min_rounds": 5, "max_rounds": 50}
        sizes = [("dense", 2000, 100), ("BCOO", 100_000, 50)]
    lines = [
        f"jax {jax.__version__}, {jax.devices()[0].platform}, float32",
        "",
        *h.table(
            "matrix | n | d | method | reortho | task | krylovjax / matfree time "
            "| krylovjax temp | matfree temp | forward mode: krylovjax / matfree "
            "| complex: krylovjax / matfree",
            [],
        ),
    ]
    records = []
    depths = (10, 100) if args.quick else (10, 1000)
    compile_rows = []
    for kind, reortho, (first, last) in compile_times(depths=depths):
        compile_rows.append([kind, reortho, *(f"{x:.2f}" for x in (first, last))])
        compile_rows[-1].append(f"{last / first:.2f}")
        records.append(
            {"compile": kind, "reortho": reortho, "depths": depths, "s": [first, last]}
        )
    compile_lines = [
        "",
        f"Compile time of `jax.grad` (dense, n = 1000, float32) at d = {depths[0]} "
        f"and d = {depths[1]}:",
        "",
        *h.table(
            f"method | reortho | d = {depths[0]} s | d = {depths[1]} s | ratio",
            compile_rows,
        ),
    ]
    if args.compile_only:
        print("\n".join(compile_lines))
        return
    print("\n".join(lines), flush=True)
    tasks = (("grad", decomposition_losses), ("f(A)b value+grad", funm_losses))
    for matrix, n, d in sizes:
        problem = dense_problem(n) if matrix == "dense" else sparse_problem(n)
        params, x0 = problem[0], problem[1]
        for kind, reortho, (task, make) in itertools.product(
            ("arnoldi", "lanczos"), ("full", "none"), tasks
        ):
            result = time_task(
                task, make(kind, d, reortho, problem), (params, x0), timing
            )
            ours, theirs = result["krylovjax"], result["matfree"]
            can = capabilities(matrix, kind, reortho, make)
            line = h.row(
                [matrix, n, d, kind, reortho, task]
                + [f"{ours['median_s'] / theirs['median_s']:.2f}"]
                + [f"{r['temp_bytes'] / 2**20:.1f} MiB" for r in (ours, theirs)]
                + [
                    f"{can['krylovjax', w]} / {can['matfree', w]}"
                    for w in ("forward", "complex")
                ]
            )
            print(line, flush=True)
            lines.append(line)
            record = {"matrix": matrix, "n": n, "d": d, "method": kind}
            record.update(reortho=reortho, task=task)
            record.update({f"{m}_{w}": v for (m, w), v in can.items()})
            for name, r in result.items():
                record[f"{name}_time_s"] = r["median_s"]
                record.update(
                    {f"{name}_{k}": r[k] for k in ("temp_bytes", "compile_s")}
                )
            records.append(record)
    print("\n".join(compile_lines))
    h.write_results(args.out, records, "\n".join(lines + compile_lines) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
