"""The GPU table: krylovjax on an accelerator, one command of under 5 minutes.

Three sections, float32, all jitted; the functions of one row are timed side by
side in interleaved rounds (medians), and each section's wall time is printed:

1. `krylov`: `method="scan"` against `method="doubling"` against plain autodiff
   through a `lax.scan` (`bench_krylov.krylov_scan`), the forward pass and
   `jax.grad` of `sum(X * W)` with respect to `A` and `x0`, for (n, d) from
   (16, 4096) to (4096, 256), `x0` a vector and a block of 8 (`A` orthogonal).
2. `graph`: `krylovjax.nn.KrylovGraphConv(128, 64, num_hops=3)` on the random graph
   of `bench_graphs.py` with 1M nodes (average degree 15, self-loops included,
   normalised; BCOO): forward, and the gradient of `sum(out * V)` with respect to
   the layer and the node features, against the same layer on a plain `lax.scan`.
3. `lanczos`: `lanczos` and `funm_action(jnp.exp, ...)` at (n, d) = (100k, 50),
   the operator the SPD BCOO matrix I + Â/2 of such a graph (average degree 11):
   forward, and the gradient (for f(A)b value and gradient) of a loss on every
   output with respect to its stored values and the start vector, the default
   rule against plain autodiff of the same loop (`adjoint="autodiff"`).

A function that runs out of memory (or fails otherwise) is reported in its cell and
the run goes on. `--fast` takes n and d over 16 (at least 4; `krylov` at three of
its five sizes; the graph has 5000 nodes) and few rounds, so that the script runs
on a 2-core CPU in under a minute (compiling, mostly): CI runs
`python benchmarks/gpu.py --fast` to keep it working. It runs on JAX's default
backend, named in the header. Results go to `--out` (default
`benchmarks/out/gpu`, git-ignored): `results.json` and `results.md`.
"""

import argparse
import functools
from pathlib import Path

import _harness as h
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from bench_graphs import make_graph
from bench_krylov import krylov_scan, make_functions, problem
from jax.experimental import sparse

import krylovjax
from krylovjax.nn import KrylovGraphConv

SECTIONS = ("krylov", "graph", "lanczos")
KRYLOV_SIZES = [(16, 4096), (64, 2048), (256, 1024), (1024, 512), (4096, 256)]
BLOCK = 8
GRAPH = {"n": 1_000_000, "degree": 15, "features": 128, "out": 64, "d": 4}
LANCZOS = {"n": 100_000, "d": 50, "degree": 11}
TIMING = {"target_s": 0.2, "min_rounds": 5, "max_rounds": 100, "batch_s": 0.01}
FAST_TIMING = {"target_s": 0.01, "min_rounds": 3, "max_rounds": 5}
KRYLOV = {
    "scan": lambda A, x0, d: krylovjax.krylov(A, x0, d, method="scan"),
    "doubling": lambda A, x0, d: krylovjax.krylov(A, x0, d, method="doubling"),
    "autodiff": krylov_scan,
}


def small(x: int) -> int:
    return max(x // 16, 4)


def cell(r, field="median_s") -> str:
    """A time in ms, or why there is none."""
    return r if isinstance(r, str) else h.ms(r[field])


def over(a, b) -> str:
    ok = isinstance(a, dict) and isinstance(b, dict)
    return h.fmt(h.ratio(a["median_s"], b["median_s"]) if ok else None)


def difference(got, want) -> str:
    """The largest relative difference of `got`'s outputs from `want`'s, over pairs
    of results."""
    pairs = list(zip(got, want, strict=True))
    if not all(isinstance(a, dict) and isinstance(b, dict) for a, b in pairs):
        return "-"
    return (
        f"{max(h.largest_difference(a['output'], b['output']) for a, b in pairs):.1e}"
    )


def temp(r) -> str:
    return h.fmt(r["temp_bytes"] / 2**20, ".1f") if isinstance(r, dict) else "-"


def strip(results: dict) -> dict:
    """The results without their outputs, for the JSON report."""
    return {
        " ".join(k): r
        if isinstance(r, str)
        else {x: v for x, v in r.items() if x != "output"}
        for k, r in results.items()
    }


def krylov_section(sizes, timing, log) -> list[dict]:
    rows = []
    for b in (None, BLOCK):
        for n, d in sizes:
            try:
                A, x0, W = problem(n, d, b)
            except Exception as error:  # noqa: BLE001 (reported in its row)
                rows.append({"n": n, "d": d, "b": b, "failed": h.failure(error)})
                continue
            fns = {}
            for name, build in KRYLOV.items():
                forward, grad = make_functions(build, d)
                fns[name, "forward"] = (forward, (A, x0))
                fns[name, "grad"] = (grad, (A, x0, W))
            got = h.measure(fns, outputs=True, catch=True, **timing)
            del A, x0, W
            rows.append({"n": n, "d": d, "b": b, "got": got})
            log(
                f"  n={n:<5} d={d:<5} b={b}: grad ms "
                + ", ".join(f"{m} {cell(got[m, 'grad'])}" for m in KRYLOV)
            )
    return rows


def krylov_table(rows) -> list[str]:
    out, kinds = [], ("forward", "grad")
    for r in rows:
        head = ["vector" if r["b"] is None else f"block {r['b']}", r["n"], r["d"]]
        if "failed" in r:
            out.append([*head, r["failed"], *[""] * 11])
            continue
        got, fast = r["got"], ("scan", "doubling")
        out.append(
            head
            + [cell(got[m, k]) for k in kinds for m in KRYLOV]
            + [over(got[m, k], got["autodiff", k]) for k in kinds for m in fast]
            + [
                difference(
                    [got[m, k] for k in kinds], [got["autodiff", k] for k in kinds]
                )
                for m in fast
            ]
        )
    return h.table(
        "x0 | n | d | fwd scan ms | fwd doubling ms | fwd autodiff ms | grad scan ms "
        "| grad doubling ms | grad autodiff ms | fwd scan / autodiff "
        "| fwd doubling / autodiff | grad scan / autodiff | grad doubling / autodiff "
        "| rel. diff scan | rel. diff doubling",
        out,
    )


def plain_conv(model: KrylovGraphConv, A, H):
    """`KrylovGraphConv`'s output with its features from a plain `lax.scan`."""
    features = krylov_scan(A, H, model.num_hops + 1)  # (n, num_hops + 1, in)
    out = features.reshape(H.shape[0], -1) @ model.weight.T
    return out + model.bias[None, :]


def graph_section(cfg, timing, log) -> dict:
    n = cfg["n"]
    g = make_graph(n, cfg["degree"], cfg["features"], cfg["d"], cfg["out"], 0)
    log(f"  graph: n = {n}, nnz = {g['nnz']}")
    model = KrylovGraphConv(
        cfg["features"], cfg["out"], cfg["d"] - 1, key=jax.random.key(0)
    )
    weights = jnp.asarray(g["conv_weight"]), jnp.asarray(g["conv_bias"])
    model = eqx.tree_at(lambda m: (m.weight, m.bias), model, weights)
    indices = jnp.asarray(np.stack([g["rows"], g["cols"]], axis=1))
    # Every array an argument, none a constant of the compiled program.
    args = (
        model,
        jnp.asarray(g["values"]),
        indices,
        jnp.asarray(g["X"]),
        jnp.asarray(g["V"]),
    )
    del g
    fns = {}
    for name, layer in (
        ("KrylovGraphConv", lambda m, A, H: m(A, H)),
        ("plain scan", plain_conv),
    ):

        def forward(model, data, indices, H, V, layer=layer):
            return layer(model, sparse.BCOO((data, indices), shape=(n, n)), H)

        def loss(model, data, indices, H, V, layer=layer):
            return jnp.sum(forward(model, data, indices, H, V, layer) * V)

        fns[name, "forward"] = (forward, args)
        fns[name, "grad"] = (jax.grad(loss, argnums=(0, 3)), args)
    got = h.measure(fns, outputs=True, catch=True, **timing)
    for k in ("forward", "grad"):
        times = [f"{m} {cell(got[m, k])} ms" for m in ("KrylovGraphConv", "plain scan")]
        log(f"  {k}: " + ", ".join(times))
    return {"n": n, "nnz": int(indices.shape[0]), "got": got}


def graph_table(section) -> list[str]:
    rows = []
    for k in ("forward", "grad"):
        a, b = (section["got"][m, k] for m in ("KrylovGraphConv", "plain scan"))
        rows.append(
            [k, section["n"], section["nnz"], cell(a), cell(b), over(a, b)]
            + [temp(a), temp(b), difference([a], [b])]
        )
    return h.table(
        "case | n | nnz | KrylovGraphConv ms | plain scan ms | KrylovGraphConv / plain "
        "scan | KrylovGraphConv temp MiB | plain scan temp MiB | rel. diff",
        rows,
    )


def lanczos_section(cfg, timing, log) -> dict:
    n, d = cfg["n"], cfg["d"]
    g = make_graph(n, cfg["degree"], 1, 1, 1, 1)
    # I + Â/2: Â's eigenvalues lie in (-1, 1], so this one's lie in (1/2, 3/2].
    diagonal = np.arange(n, dtype=np.int32)
    rows, cols = (np.concatenate([g[k], diagonal]) for k in ("rows", "cols"))
    values = np.concatenate([g["values"] / 2, np.ones(n, np.float32)])
    del g
    keys = jax.random.split(jax.random.key(2), 4)
    x0 = jax.random.normal(keys[0], (n,), jnp.float32)
    # The loss weights: of the basis, of T and of f(A) b.
    W = jax.random.normal(keys[1], (n, d), jnp.float32)
    V = jax.random.normal(keys[2], (d, d), jnp.float32)
    w = jax.random.normal(keys[3], (n,), jnp.float32)
    indices = jnp.asarray(np.stack([rows, cols], axis=1))
    args = (jnp.asarray(values), x0, indices, W, V, w)

    def lanczos(p, x0, indices, W, V, w, adjoint="custom_jvp"):
        A = sparse.BCOO((p, indices), shape=(n, n))
        return krylovjax.lanczos(A, x0, d, adjoint=adjoint)

    def funm(p, x0, indices, W, V, w, adjoint="custom_jvp"):
        A = sparse.BCOO((p, indices), shape=(n, n))
        return krylovjax.funm_action(
            jnp.exp, A, x0, d, method="lanczos", adjoint=adjoint
        )

    def lanczos_loss(*args, adjoint):
        out = lanczos(*args, adjoint=adjoint)
        return jnp.sum(out.basis * args[3]) + jnp.sum(out.matrix() * args[4])

    def funm_loss(*args, adjoint):
        return jnp.sum(funm(*args, adjoint=adjoint) * args[5])

    fns = {("lanczos", "forward", "krylovjax"): (lanczos, args)}
    fns["funm_action", "forward", "krylovjax"] = (funm, args)
    for adjoint, tag in (("custom_jvp", "krylovjax"), ("autodiff", "autodiff")):
        grad = jax.grad(functools.partial(lanczos_loss, adjoint=adjoint), (0, 1))
        fns["lanczos", "grad", tag] = (grad, args)
        vg = jax.value_and_grad(functools.partial(funm_loss, adjoint=adjoint), (0, 1))
        fns["funm_action", "value+grad", tag] = (vg, args)
    got = h.measure(fns, outputs=True, catch=True, **timing)
    for key, r in got.items():
        log(f"  {' '.join(key[:2]):>24} {key[2]:>9}: {cell(r)} ms")
    return {"n": n, "d": d, "nnz": int(indices.shape[0]), "got": got}


LANCZOS_TASKS = [("lanczos", "forward"), ("lanczos", "grad")]
LANCZOS_TASKS += [("funm_action", "forward"), ("funm_action", "value+grad")]


def lanczos_table(section) -> list[str]:
    rows = []
    for task in LANCZOS_TASKS:
        kj, ad = (section["got"].get((*task, x)) for x in ("krylovjax", "autodiff"))
        pair = [cell(ad), over(kj, ad), difference([kj], [ad])] if ad else ["-"] * 3
        rows.append([" ".join(task), section["n"], section["d"], cell(kj), *pair])
    return h.table(
        "task | n | d | krylovjax ms | autodiff ms | krylovjax / autodiff | rel. diff",
        rows,
    )


def markdown(report: dict) -> str:
    m, c = report["machine"], report["config"]
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in report["section_s"].items())
    lines = [
        "# krylovjax on an accelerator",
        "",
        f"Device: {m['device']} ({m['backend']}, {m['device_kind']}); jax "
        f"{m['versions']['jax']}, jaxlib {m['versions']['jaxlib']}, krylovjax "
        f"{m['versions']['krylovjax']}, commit `{m['git_commit']}`, {m['cpu_count']} "
        f"CPUs, Python {m['python']}. Mode: {report['mode']}; float32; medians of "
        f"interleaved rounds (about {c['timing']['target_s']} s per function); total "
        f"run time {report['total_s']:.0f} s ({sections}).",
        "",
    ]
    if "krylov" in report:
        lines += [
            "## `krylov`: scan, doubling and plain autodiff",
            "",
            "Forward pass and `jax.grad` of `sum(X * W)` with respect to `A` and `x0`; "
            "`autodiff` is a plain `lax.scan` differentiated by JAX. `rel. diff`: the "
            "largest |difference| / largest |value| of the outputs and gradients "
            "against autodiff's.",
            "",
            *krylov_table(report["krylov"]),
            "",
        ]
    if "graph" in report:
        lines += [
            "## `KrylovGraphConv` on a sparse graph",
            "",
            f"`KrylovGraphConv({c['graph']['features']}, {c['graph']['out']}, "
            f"num_hops={c['graph']['d'] - 1})` on a random graph (average degree "
            f"{c['graph']['degree']}, self-loops included, normalised), BCOO; `grad`: "
            "the gradient of `sum(out * V)` with respect to the layer and the node "
            "features. `plain scan`: the same layer with its features from a "
            "`lax.scan`, differentiated by JAX. Temporary memory: XLA's compiled "
            "temporaries.",
            "",
            *graph_table(report["graph"]),
            "",
        ]
    if "lanczos" in report:
        lines += [
            "## `lanczos` and `funm_action(jnp.exp, ...)`",
            "",
            "The operator: I + Â/2 of a random graph (BCOO, SPD). Loss: `sum(Q * W) + "
            "sum(T * V)` for `lanczos`, `sum(f(A) b * w)` for `funm_action`, "
            "differentiated with respect to the stored values and the start vector; "
            '`autodiff`: `adjoint="autodiff"`, JAX\'s own rules through the same loop.',
            "",
            *lanczos_table(report["lanczos"]),
            "",
        ]
    for name, why in report.get("failed", {}).items():
        lines += [f"Section `{name}`: {why}.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="small sizes (CPU, CI)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "out" / "gpu",
        help="output folder (default: benchmarks/out/gpu, git-ignored)",
    )
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if any(s not in SECTIONS for s in sections):
        parser.error(f"--sections: each of {', '.join(SECTIONS)}; got {args.sections}")
    timing = FAST_TIMING if args.fast else TIMING
    sizes = (
        [(small(n), small(d)) for n, d in KRYLOV_SIZES[::2]]
        if args.fast
        else KRYLOV_SIZES
    )
    graph = {**GRAPH, "n": 5000} if args.fast else GRAPH
    lanczos = (
        {**LANCZOS, "n": small(LANCZOS["n"]), "d": small(LANCZOS["d"])}
        if args.fast
        else LANCZOS
    )
    log = h.Log()
    device = jax.devices()[0]
    log(f"device: {device} ({jax.default_backend()}, {device.device_kind})")
    report: dict = {"mode": "fast" if args.fast else "full", "section_s": {}}
    config = {
        "timing": timing,
        "krylov_sizes": sizes,
        "block": BLOCK,
        "graph": graph,
        "lanczos": lanczos,
    }
    runs = {
        "krylov": lambda: krylov_section(sizes, timing, log),
        "graph": lambda: graph_section(graph, timing, log),
        "lanczos": lambda: lanczos_section(lanczos, timing, log),
    }
    for name in sections:
        start = log.elapsed()
        log(f"section {name}")
        try:
            report[name] = runs[name]()
        except Exception as error:  # noqa: BLE001 (reported, the run goes on)
            report.setdefault("failed", {})[name] = h.failure(error)
            log(f"  {name}: {report['failed'][name]}")
        report["section_s"][name] = log.elapsed() - start
        log(f"section {name}: {report['section_s'][name]:.1f} s")
    report.update(
        machine=h.machine_info("equinox"), config=config, total_s=log.elapsed()
    )
    text = markdown(report)
    print(text)
    for r in [*report.get("krylov", []), report.get("graph"), report.get("lanczos")]:
        if r and "got" in r:
            r["got"] = strip(r["got"])
    h.write_results(args.out, report, text)
    log(f"wrote {args.out}/results.json, results.md")
    return report


if __name__ == "__main__":
    main()
