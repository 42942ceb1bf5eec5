"""What the benchmark scripts share: timing, memory, the machine, output, old code.

- Timing: `compile_timed` (`lower` + `compile`, wall time), `ready` (a call that
  returns once its outputs are computed), `time_interleaved` (several functions
  timed side by side in interleaved rounds) and `measure`, which compiles a set of
  functions, reads their `memory` (XLA's compiled temporary, argument and output
  bytes), calls each once and times them all side by side.
- `largest_difference`: how far two results are apart, relative to the second.
- `machine_info`: versions, backend and device, cores, Python, git commit, time.
- Output: `table` (a Markdown table), `write_results` (`results.json` and
  `results.md`), the cell formats `fmt`, `ratio`, `ms`, `kib`, `gb`, and `Log`,
  which prints each line with the seconds since the run started.
- Child processes: `run_child` starts one, kills it if its resident set passes a
  limit and returns its JSON report with its peak RSS; `maxrss_bytes` and
  `proc_status` are what a child reports.
- `import_at`: the package as committed at a git revision, imported beside the
  working tree's, so that one run can time the old and the new code side by side.

JAX is imported only inside the functions that use it: `bench_graphs.py`'s parent
process, whose children's peak RSS starts from its own, must stay small.
"""

import atexit
import importlib
import importlib.metadata
import io
import json
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

GB = 2**30
REPO = Path(__file__).resolve().parent.parent
NOT_INSTALLED = "not installed"


# Timing and memory.


def cpu_by_default() -> None:
    """Make JAX run on the CPU unless `JAX_PLATFORMS` names a platform: the scripts
    that call this measure the CPU (`gpu.py` measures an accelerator). Call it
    before JAX first uses a device; child processes inherit the choice."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def compile_timed(fn: Callable, args: Sequence) -> tuple[Any, float]:
    """`jax.jit(fn)` lowered and compiled for `args`, and the seconds it took (pass
    a freshly defined `fn` so that no cache is hit)."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def memory(compiled: Any) -> dict[str, int | None]:
    """XLA's `memory_analysis()` of a compiled function: `temp_bytes` (the
    temporaries: what depends on the algorithm), `output_bytes`, `argument_bytes`."""
    analysis = compiled.memory_analysis()
    return {
        f"{kind}_bytes": None
        if analysis is None
        else int(getattr(analysis, f"{kind}_size_in_bytes"))
        for kind in ("temp", "output", "argument")
    }


def ready(fn: Callable, args: Sequence) -> Callable[[], Any]:
    """A call of `fn(*args)` that returns once its outputs are computed."""
    import jax

    return lambda: jax.block_until_ready(fn(*args))


def _seconds(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def time_interleaved(
    calls: Sequence[Callable[[], Any]],
    *,
    target_s: float = 0.3,
    min_rounds: int = 5,
    max_rounds: int = 200,
    batch_s: float = 1e-3,
    max_batch: int = 100,
    shared_batch: bool = False,
) -> list[dict[str, Any]]:
    """Time several functions side by side: the median time per call of each.

    Every call must return only once its work is done (see `ready`). Each function
    is called once to warm up and timed over three calls (fewer if they take more
    than a second); the fastest sets its batch: as many calls as take about
    `batch_s`, between 1 and `max_batch` (with `shared_batch`, one batch for all,
    set by the fastest function: compare functions of the same kind so, since
    calling one function over and over runs faster than alternating). Each round
    runs every function's batch in turn, in an order shuffled every round, and
    records its mean time per call; there are enough rounds for about `target_s`
    per function, between `min_rounds` and `max_rounds` (equal bounds fix the
    count). Interleaving makes load from elsewhere on the machine hit all functions
    alike, so their ratios hold.

    Returns, per function: `median_s`, `min_s`, `times_s` (every round's),
    `rounds` and `calls_per_round`.
    """
    once = []
    for call in calls:
        call()
        seconds = [_seconds(call)]
        while len(seconds) < 3 and sum(seconds) < 1.0:
            seconds.append(_seconds(call))
        once.append(min(seconds))

    def batch(seconds):
        return max(1, min(max_batch, int(batch_s / max(seconds, 1e-7))))

    batches = [batch(min(once)) if shared_batch else batch(t) for t in once]
    per_round = sum(b * t for b, t in zip(batches, once, strict=True))
    rounds = int(target_s * len(calls) / max(per_round, 1e-7))
    rounds = min(max(rounds, min_rounds), max_rounds)
    times: list[list[float]] = [[] for _ in calls]
    order, rng = list(range(len(calls))), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for i in order:
            start = time.perf_counter()
            for _ in range(batches[i]):
                calls[i]()
            times[i].append((time.perf_counter() - start) / batches[i])
    return [
        {
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "times_s": ts,
            "rounds": rounds,
            "calls_per_round": b,
        }
        for ts, b in zip(times, batches, strict=True)
    ]


def measure(
    fns: Mapping[Any, tuple[Callable, Sequence]],
    *,
    outputs: bool = False,
    catch: bool = False,
    **timing: Any,
) -> dict[Any, Any]:
    """Compile each `fn` of `{name: (fn, args)}` for its `args`, read its memory,
    call it once, then time them all side by side (`time_interleaved`, which gets
    the keywords `timing`).

    Returns, per name, a dict of `compile_s`, the `memory` fields and the
    `time_interleaved` fields, and with `outputs` also `output`: the outputs of the
    first call as NumPy arrays. With `catch`, a function that fails to compile or
    to run (out of memory, say) gets the string `failure(error)` instead, and the
    others are timed (if the timing itself fails, every function gets its error).
    """
    import jax

    results: dict[Any, Any] = {}
    calls = {}
    for name, (fn, args) in fns.items():
        try:
            compiled, compile_s = compile_timed(fn, args)
            result = {"compile_s": compile_s, **memory(compiled)}
            call = ready(compiled, args)
            out = call()
            if outputs:
                result["output"] = jax.tree.map(np.asarray, out)
            del out
        except Exception as error:
            if not catch:
                raise
            results[name] = failure(error)
            continue
        results[name], calls[name] = result, call
    try:
        timed = time_interleaved(list(calls.values()), **timing)
    except Exception as error:
        if not catch:
            raise
        return results | {name: failure(error) for name in calls}
    for name, t in zip(calls, timed, strict=True):
        results[name].update(t)
    return results


def is_memory_error(text: str) -> bool:
    lowered = text.lower()
    words = ("memory", "resource_exhausted", "bad_alloc", "cannot allocate")
    return any(word in lowered for word in words)


def failure(error: BaseException) -> str:
    """The table cell of a function that failed: "out of memory (...)" or
    "fails (...)", with the start of the error."""
    text = f"{type(error).__name__}: {str(error)[:120]}"
    return f"{'out of memory' if is_memory_error(text) else 'fails'} ({text})"


def largest_difference(got: Any, want: Any) -> float:
    """The largest `|got - want|` over the largest `|want|`, the worst over the
    leaves of two pytrees of arrays of the same structure."""
    import jax

    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if b.size:
            scale = max(float(np.max(np.abs(b))), 1e-30)
            worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    return worst


# The machine.


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def machine_info(*dists: str) -> dict[str, Any]:
    """The command, the `versions` of jax, jaxlib, krylovjax and `dists`, Python,
    the platform, the CPU count and the cores this process may use, the git commit,
    the thread settings and the time; if JAX is imported, its backend and device."""
    try:
        commit = git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        commit = None
    info = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "versions": {d: version(d) for d in ("jax", "jaxlib", "krylovjax", *dists)},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cores": cores(),
        "git_commit": commit,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if "jax" in sys.modules:
        import jax

        device = jax.devices()[0]
        info.update(
            backend=jax.default_backend(),
            device=str(device),
            device_kind=device.device_kind,
        )
    return info


# Output.


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def ms(seconds: float | None, spec: str = ".3g") -> str:
    return fmt(None if seconds is None else seconds * 1e3, spec)


def kib(n_bytes: float | None) -> str:
    return fmt(None if n_bytes is None else n_bytes / 1024, ".1f")


def gb(n_bytes: float | None) -> str:
    return fmt(None if n_bytes is None else n_bytes / GB, ".2f")


def table(
    header: str | Sequence[str], rows: Iterable[Sequence[Any]], align: str = ""
) -> list[str]:
    """The lines of a Markdown table. `header` is a list of column names or one
    string of them separated by `|`; `align` has a letter per column, `l` or `r`
    (right-aligned), or is empty for no alignment marks."""
    if isinstance(header, str):
        header = [name.strip() for name in header.split("|")]

    marks = ["---:" if a == "r" else "---" for a in align or "l" * len(header)]
    return [row(header), "|" + "|".join(marks) + "|", *map(row, rows)]


def row(cells: Iterable[Any]) -> str:
    """One line of a Markdown table."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def write_results(out: Path, report: Any, markdown: str, stem: str = "results"):
    """`report` as `out/<stem>.json` and `markdown` as `out/<stem>.md`."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1, default=_plain)
    (out / f"{stem}.json").write_text(text + "\n")
    (out / f"{stem}.md").write_text(markdown)


def _plain(x: Any) -> Any:
    """A NumPy scalar as a Python number; anything else JSON lacks as its `str`."""
    return x.item() if hasattr(x, "item") else str(x)


class Log:
    """Prints each message with the seconds since the `Log` was made."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


# Child processes and their peak RSS.


def maxrss_bytes() -> int:
    """This process's peak RSS (`ru_maxrss`), which on Linux starts from the RSS of
    the process that started it: the high-water mark survives fork and exec."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """`Vm*` lines of /proc/PID/status, in bytes (empty where there is no /proc)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Vm"):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def run_child(cmd: list[str], json_path: Path, limit_gb: float, quiet: bool) -> dict:
    """Run `cmd --child-json json_path`, kill it if its RSS passes `limit_gb` (0: no
    limit), and return the JSON report it left, with its command, wall time, exit
    status and `peak_rss` (also from `wait4`, so that a killed child has one). A
    child that was killed, or reported an `error`, gets a `killed` line saying so.
    Its stderr goes to `json_path` with the suffix `.log`.
    """
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.unlink(missing_ok=True)
    log_path = json_path.with_suffix(".log")
    limit = limit_gb * GB if limit_gb > 0 else None
    start = time.perf_counter()
    sys.stdout.flush()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [*cmd, "--child-json", str(json_path)],
            stdout=subprocess.DEVNULL if quiet else None,
            stderr=log_file,
        )
        watchdog = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if limit is not None and proc_status(proc.pid).get("VmRSS", 0) > limit:
                os.kill(proc.pid, signal.SIGKILL)
                watchdog = True
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.01)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped above
    report = json.loads(json_path.read_text()) if json_path.exists() else {}
    peak = max(report.get("peak_rss") or 0, usage.ru_maxrss * 1024)
    result = {
        **report,
        "command": shlex.join(cmd),
        "wall_s": time.perf_counter() - start,
        "exit": proc.returncode,
        "wait4_maxrss": usage.ru_maxrss * 1024,
        "peak_rss": peak,
    }
    if watchdog:
        result["killed"] = (
            f"killed at {peak / GB:.2f} GB (RSS over --rss-limit-gb {limit_gb:g})"
        )
    elif "error" in report:
        what = "killed" if is_memory_error(report["error"]) else "failed"
        result["killed"] = f"{what} at {peak / GB:.2f} GB ({report['error'][:200]})"
    elif proc.returncode != 0:
        result["killed"] = (
            f"killed at {peak / GB:.2f} GB (exit {proc.returncode}; see "
            f"{log_path.parent.name}/{log_path.name})"
        )
    return result


# The package at another revision.


def import_at(ref: str, package: str = "krylovjax") -> Any:
    """The package as committed at git revision `ref`, imported beside the one the
    scripts import (the working tree's, for an editable install).

    `git archive` exports its folder into a temporary directory (removed at exit),
    renamed `<package>_at_<short commit>`, which is imported under that name: this
    works because the package imports its own modules relatively. Raises a
    `ValueError` if `ref` is not a revision of this repository.
    """
    try:
        short = git("rev-parse", "--short", f"{ref}^{{commit}}")
        archive = subprocess.run(
            ["git", "archive", short, package],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except subprocess.CalledProcessError as error:
        said = error.stderr
        said = said if isinstance(said, str) else said.decode(errors="replace")
        msg = (
            f"`--against {ref}` must name a git revision of {REPO} that holds "
            f"`{package}/`; git says: {said.strip()}"
        )
        raise ValueError(msg) from None
    name = f"{package}_at_{short}"
    if name in sys.modules:
        return sys.modules[name]
    folder = Path(tempfile.mkdtemp(prefix=f"{name}_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / package).rename(folder / name)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
