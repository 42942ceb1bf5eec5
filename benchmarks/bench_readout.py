"""Benchmark `krylov_readout` and `polynomial_action` against the materialising path.

Three parts, each timed side by side in one process (float32, CPU), with XLA's
compiled temporary memory:

- **SSM kernel**: `StateSpaceConv`'s kernel $\\bar K_l = C \\bar A^l \\bar B$ at
  state size n = 64, c_in = 256 input channels, one output channel, length
  L = 16384: the value and gradient (in $\\bar A$, $\\bar B$, $C$) of
  `sum(K * W)` by `krylov_readout(A_bar, B_bar, L, C, layout="rows")` and by the
  materialising kernel, `einsum(C, krylov(A_bar, B_bar, L, layout="rows"))` (the
  layer's kernel before the readouts), and the largest relative difference of the
  kernels.
- **Sizes** (512, 200) and (32, 5000), dense `A`, vector `x0`: the forward pass,
  and the gradient (in `A`, `x0` and the readout) of `sum(sin(C X))` for
  `krylov_readout` with `C` of 8 rows, and of `sum(sin(y))` for
  `polynomial_action`, each against the same loss through `krylov` (the
  materialising path), and against two references written out by hand:
  `floor_fn` (the chains of products and their pairing alone) and `minimal_fn`
  (the function's own gradient by the adjoint recurrence, with nothing more).
- **Checkpoints**: the SSM kernel's gradient for several `checkpoints` (how
  many vectors the reverse pass keeps), the trade-off that argument sets.

Run `python benchmarks/bench_readout.py` (about two minutes on 2 cores) or
`--quick`. Results go to `--out` (default `benchmarks/out/readout`, git-ignored):
`results.json` and `results.md`; `--docs` also writes the table to
`docs/benchmarks/readout.md`.
"""

import argparse
import contextlib
from pathlib import Path

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np

import krylovjax
import krylovjax._readout as readout_module
from krylovjax._readout import default_checkpoints
from krylovjax.nn import StateSpaceConv

FULL = {
    "ssm": (64, 256, 16384),
    "checkpoints": [16, 64, None, 1024],
    "sizes": [(512, 200), (32, 5000)],
    # The reverse pass's settings: (n, d), then (steps per chunk, stacked, one
    # product) per row; None steps: the default.
    "chunks": [
        (
            (32, 5000),
            [(64, True, True), (512, True, True), (None, False, True)]
            + [(None, True, True)],
        ),
        (
            (512, 200),
            [(24, True, False), (24, True, True), (None, True, False)]
            + [(None, True, True)],
        ),
    ],
    "timing": {"target_s": 1.0, "min_rounds": 5, "max_rounds": 50},
}
QUICK = {
    "ssm": (8, 4, 64),
    "checkpoints": [2, None],
    "sizes": [(16, 20)],
    "chunks": [((16, 20), [(4, True, True), (None, False, False)])],
    "timing": {"target_s": 0.02, "min_rounds": 3, "max_rounds": 5},
}
READOUTS = 8


def ssm_problem(n, c_in, length):
    layer = StateSpaceConv(n, c_in, 1, length, dtype=jnp.float32, key=jax.random.key(0))
    A_bar, B_bar = jax.jit(lambda layer: layer.discretise())(layer)
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.standard_normal((length, 1, c_in)), jnp.float32)
    return A_bar, B_bar, layer.C, W


def ssm_kernel(length, checkpoints=None, materialise=False):
    def kernel(A_bar, B_bar, C):
        if materialise:
            blocks = krylovjax.krylov(A_bar, B_bar, length, layout="rows")
            return jnp.einsum("on,lni->loi", C, blocks)
        return krylovjax.krylov_readout(
            A_bar, B_bar, length, C, layout="rows", checkpoints=checkpoints
        )

    return kernel


def value_and_grad(kernel):
    def loss(A_bar, B_bar, C, W):
        return jnp.sum(kernel(A_bar, B_bar, C) * W)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def run_ssm(n, c_in, length, checkpoints, timing):
    args = ssm_problem(n, c_in, length)
    fns = {
        "readout": (value_and_grad(ssm_kernel(length)), args),
        "materialising": (value_and_grad(ssm_kernel(length, materialise=True)), args),
    }
    results = h.measure(fns, **timing)
    kernels = [
        jax.jit(ssm_kernel(length, materialise=m))(*args[:3]) for m in (False, True)
    ]
    kept = h.measure(
        {str(c): (value_and_grad(ssm_kernel(length, c)), args) for c in checkpoints},
        **timing,
    )
    return {
        "n": n,
        "c_in": c_in,
        "length": length,
        "default_checkpoints": default_checkpoints(length, args[1], False),
        "temp_bytes": {k: v["temp_bytes"] for k, v in results.items()},
        "median_s": {k: v["median_s"] for k, v in results.items()},
        "kernel_difference": h.largest_difference(*kernels),
        "checkpoints": {
            k: {"temp_bytes": v["temp_bytes"], "median_s": v["median_s"]}
            for k, v in kept.items()
        },
    }


def size_problem(n, d):
    rng = np.random.default_rng(1)
    A = jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n) / 2, jnp.float32)
    x0 = jnp.asarray(rng.standard_normal(n), jnp.float32)
    C = jnp.asarray(rng.standard_normal((READOUTS, n)) / np.sqrt(n), jnp.float32)
    theta = jnp.asarray(rng.standard_normal(d) / d, jnp.float32)
    return A, x0, C, theta


def size_fns(d):
    def readout(A, x0, C, theta, materialise):
        if materialise:
            return C @ krylovjax.krylov(A, x0, d)
        return krylovjax.krylov_readout(A, x0, d, C)

    def action(A, x0, C, theta, materialise):
        del C
        if materialise:
            return krylovjax.krylov(A, x0, d) @ theta
        return krylovjax.polynomial_action(A, x0, theta)

    fns = {}
    for name, f in (("krylov_readout", readout), ("polynomial_action", action)):
        for materialise in (False, True):
            way = "materialising" if materialise else "readout"

            def forward(A, x0, C, theta, f=f, m=materialise):
                return f(A, x0, C, theta, m)

            def loss(A, x0, C, theta, f=f, m=materialise):
                return jnp.sum(jnp.sin(f(A, x0, C, theta, m)))

            fns[(name, way, "forward")] = forward
            fns[(name, way, "grad")] = jax.grad(loss, argnums=(0, 1, 2, 3))
    return fns


def floor_fn(d):
    """What any gradient in a dense `A` must do, and nothing else: the forward
    chain of d matrix-vector products (kept), the adjoint chain of d products with
    A's transpose, and the pairing of the two as one (n, d) x (d, n) GEMM. Its time
    over the forward pass's is the least grad / forward that the readouts can
    reach on this machine."""

    def floor(A, x0, C, theta):
        del C, theta

        def forward(x, _):
            return A @ x, x

        def adjoint(w, _):
            return w @ A, w

        _, X = jax.lax.scan(forward, x0, None, length=d)
        _, W = jax.lax.scan(adjoint, x0, None, length=d)
        return W.T @ X

    return floor


def minimal_fn(name, d):
    """The gradient of `name`'s loss written out by hand, the least that a
    gradient by the adjoint recurrence does for it: the forward chain of d
    products (kept), the readout and its cotangents as one product each, the
    adjoint chain of d products with A's transpose plus each step's cotangent,
    and the pairings (the gradients of `A` and of the readout) as one product
    each (`floor_fn` is this without the readout's own work)."""

    def chain(A, x0):
        _, X = jax.lax.scan(lambda x, _: (A @ x, x), x0, None, length=d)
        return X  # (d, n)

    def adjoint(A, G):
        # lambda_k = g_k + A^T lambda_{k+1}, from the last step to the first.
        def step(w, g):
            lam = g + w @ A
            return lam, lam

        return jax.lax.scan(step, jnp.zeros_like(G[0]), G, reverse=True)[1]

    def readout(A, x0, C, theta):
        X = chain(A, x0)
        ct = jnp.cos(C @ X.T)  # (p, d)
        L = adjoint(A, (C.T @ ct).T)
        return L[1:].T @ X[:-1], L[0], ct @ X, jnp.zeros_like(theta)

    def action(A, x0, C, theta):
        X = chain(A, x0)
        ct = jnp.cos(X.T @ theta)  # (n,)
        L = adjoint(A, theta[:, None] * ct[None, :])
        return L[1:].T @ X[:-1], L[0], jnp.zeros_like(C), X @ ct

    return readout if name == "krylov_readout" else action


def check_minimal(name, d, args):
    """`minimal_fn` computes the library's gradient (float32 rounding)."""
    got = jax.jit(minimal_fn(name, d))(*args)
    want = jax.jit(size_fns(d)[(name, "materialising", "grad")])(*args)
    for g, w in zip(got, want, strict=True):
        scale = max(float(jnp.max(jnp.abs(w))), 1e-30)
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-4 * scale, name


def run_size(n, d, timing):
    args = size_problem(n, d)
    out = {"n": n, "d": d}
    for name in ("krylov_readout", "polynomial_action"):
        fns = {k: v for k, v in size_fns(d).items() if k[0] == name}
        fns[(name, "floor", "grad")] = floor_fn(d)
        fns[(name, "minimal", "grad")] = minimal_fn(name, d)
        check_minimal(name, d, args)
        results = h.measure({k: (f, args) for k, f in fns.items()}, **timing)
        median = {
            f"{way} {mode}": r["median_s"] for (_, way, mode), r in results.items()
        }
        temp = {
            f"{way} {mode}": r["temp_bytes"] for (_, way, mode), r in results.items()
        }
        out[name] = {
            "median_s": median,
            "temp_bytes": temp,
            "grad_over_forward": h.ratio(
                median["readout grad"], median["readout forward"]
            ),
            "grad_over_materialising": h.ratio(
                median["readout grad"], median["materialising grad"]
            ),
            "floor_over_forward": h.ratio(
                median["floor grad"], median["readout forward"]
            ),
            "minimal_over_forward": h.ratio(
                median["minimal grad"], median["readout forward"]
            ),
        }
    return out


@contextlib.contextmanager
def reverse_settings(chunk, n, stacked, whole):
    """Trace with reverse chunks of `chunk` steps for vectors of `n` numbers
    (`None`: the default), with the readout read from the stored vectors at once
    (`stacked`, the default) or piece by piece in the forward loop, and with a
    dense matrix's gradient one product per chunk (`whole`) or summed in blocks
    of rows: the defaults this part measures, set on `krylovjax._readout` for the
    trace only."""
    names = ("CHUNK_NUMBERS", "WHOLE_PRODUCT_NUMBERS")
    saved = [getattr(readout_module, k) for k in names], readout_module.Rows.reads_stack
    if chunk is not None:
        readout_module.CHUNK_NUMBERS = chunk * n
    if not whole:
        readout_module.WHOLE_PRODUCT_NUMBERS = 0
    if not stacked:
        readout_module.Rows.reads_stack = lambda self, xs: False
    try:
        yield
    finally:
        for k, v in zip(names, saved[0], strict=True):
            setattr(readout_module, k, v)
        readout_module.Rows.reads_stack = saved[1]


def setting_name(chunk, stacked, whole):
    steps = "default chunks" if chunk is None else f"chunks of {chunk}"
    read = "stacked" if stacked else "per step"
    product = "one product" if whole else "row blocks"
    return f"{read}, {steps}, {product}"


def run_chunks(n, d, settings, timing):
    """`krylov_readout`'s gradient at (n, d) (the loss of the sizes part) with
    each of `settings` (`reverse_settings`'s arguments but `n`), side by side with
    the forward pass."""
    args = size_problem(n, d)

    def forward(A, x0, C, theta):
        del theta
        return krylovjax.krylov_readout(A, x0, d, C)

    compiled = {"forward": h.compile_timed(forward, args)[0]}
    for chunk, stacked, whole in settings:
        with reverse_settings(chunk, n, stacked, whole):
            # A fresh function per trace, so that no traced program is reused.
            def loss(A, x0, C, theta):
                return jnp.sum(jnp.sin(forward(A, x0, C, theta)))

            grad = jax.grad(loss, argnums=(0, 1, 2))
            key = setting_name(chunk, stacked, whole)
            compiled[key] = h.compile_timed(grad, args)[0]
    names = list(compiled)
    times = h.time_interleaved([h.ready(compiled[k], args) for k in names], **timing)
    median = {k: t["median_s"] for k, t in zip(names, times, strict=True)}
    return {
        "n": n,
        "d": d,
        "median_s": median,
        "grad_over_forward": {
            k: h.ratio(v, median["forward"])
            for k, v in median.items()
            if k != "forward"
        },
    }


def mib(n_bytes):
    return h.fmt(n_bytes / 2**20, ".3g")


def markdown(report):
    m, s = report["machine"], report["ssm"]
    t, mem = s["median_s"], s["temp_bytes"]
    lines = [
        f"SSM kernel, n = {s['n']}, c_in = {s['c_in']}, L = {s['length']}, one output "
        "channel, float32: value and gradient of `sum(K * W)`.",
        "",
        *h.table(
            "path | temp MiB | time (ms) | kernel rel. diff",
            [
                (
                    "`krylov_readout`",
                    mib(mem["readout"]),
                    h.ms(t["readout"]),
                    h.fmt(s["kernel_difference"], ".1e"),
                ),
                (
                    "materialising (`krylov` + einsum)",
                    mib(mem["materialising"]),
                    h.ms(t["materialising"]),
                    "-",
                ),
                (
                    "**materialising / readout**",
                    h.fmt(h.ratio(mem["materialising"], mem["readout"]), ".1f"),
                    h.fmt(h.ratio(t["materialising"], t["readout"])),
                    "",
                ),
            ],
            "lrrr",
        ),
        "",
        "Vectors kept by the reverse pass (`checkpoints`; the default keeps "
        f"{s['default_checkpoints']}), the same gradient:",
        "",
        *h.table(
            "checkpoints | temp MiB | time (ms)",
            [
                (
                    f"{k if k != 'None' else 'default'}",
                    mib(v["temp_bytes"]),
                    h.ms(v["median_s"]),
                )
                for k, v in s["checkpoints"].items()
            ],
            "lrr",
        ),
        "",
        f"Dense `A`, vector `x0`; `krylov_readout` with a ({READOUTS}, n) `C`, loss "
        "`sum(sin(C X))`; `polynomial_action`, loss `sum(sin(y))`; gradients in "
        "`A`, `x0`, `C` and the coefficients.",
        "",
    ]
    rows = []
    for r in report["sizes"]:
        for name in ("krylov_readout", "polynomial_action"):
            q = r[name]
            med = q["median_s"]
            rows.append(
                (
                    f"({r['n']}, {r['d']})",
                    f"`{name}`",
                    h.ms(med["readout forward"]),
                    h.ms(med["readout grad"]),
                    h.ms(med["materialising grad"]),
                    h.fmt(q["grad_over_forward"]),
                    h.fmt(q["floor_over_forward"]),
                    h.fmt(q["minimal_over_forward"]),
                    h.fmt(q["grad_over_materialising"]),
                    mib(q["temp_bytes"]["readout grad"]),
                    mib(q["temp_bytes"]["materialising grad"]),
                )
            )
    lines += h.table(
        "(n, d) | function | forward (ms) | grad (ms) | grad, materialising (ms) "
        "| grad / forward | floor / forward | minimal / forward "
        "| grad / materialising | grad temp MiB | materialising temp MiB",
        rows,
        "llrrrrrrrrr",
    )
    lines += [
        "",
        "",
        "The reverse pass's settings, `krylov_readout`'s gradient as above, each "
        "size's rows timed side by side with its forward pass: chunks of steps "
        "whose pairings are one GEMM (the default: as many steps as "
        "`CHUNK_NUMBERS` numbers hold, at most d), each chunk's gradient of the "
        "dense matrix one product or summed in blocks of 16 rows, and the output "
        "read from the stored vectors by one GEMM after the forward loop (stacked) "
        "or a product per step (per step).",
        "",
    ]
    rows = []
    for c in report["chunks"]:
        size = f"({c['n']}, {c['d']})"
        rows.append((size, "forward", h.ms(c["median_s"]["forward"]), ""))
        rows += [
            (size, k, h.ms(c["median_s"][k]), h.fmt(v))
            for k, v in c["grad_over_forward"].items()
        ]
    lines += h.table("(n, d) | setting | time (ms) | grad / forward", rows, "llrr")
    lines += [
        "",
        "",
        "floor: the forward chain of d products with `A`, the adjoint chain of d "
        "products with its transpose and one (n, d) x (d, n) GEMM pairing them, "
        "nothing else (`floor_fn`): the least that a gradient in `A` costs here. "
        "minimal: the function's own gradient written out by hand (`minimal_fn`, "
        "checked against the materialising path's): the floor plus the readout's "
        "products (C X, its cotangents and the gradient of C; for "
        "`polynomial_action` the sum and the coefficients' gradient) and each "
        "step's cotangent added in the adjoint chain.",
        "",
        f"jax {m['versions']['jax']}, {m['backend']}, {m['cores']} cores, {m['time']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--out", default="benchmarks/out/readout")
    parser.add_argument("--docs", action="store_true", help="also write the docs table")
    args = parser.parse_args(argv)
    h.cpu_by_default()
    config = QUICK if args.quick else FULL
    log = h.Log()
    log(f"SSM kernel {config['ssm']}")
    ssm = run_ssm(*config["ssm"], config["checkpoints"], config["timing"])
    sizes = []
    for n, d in config["sizes"]:
        log(f"size ({n}, {d})")
        sizes.append(run_size(n, d, config["timing"]))
    chunked = []
    for (n, d), settings in config["chunks"]:
        log(f"reverse settings at ({n}, {d})")
        chunked.append(run_chunks(n, d, settings, config["timing"]))
    report = {
        "machine": h.machine_info(),
        "ssm": ssm,
        "sizes": sizes,
        "chunks": chunked,
    }
    text = markdown(report)
    h.write_results(Path(args.out), report, text)
    if args.docs:
        (h.REPO / "docs/benchmarks/readout.md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
