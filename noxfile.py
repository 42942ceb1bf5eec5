"""Sessions that mirror CI: `nox -s tests lint typecheck examples docs`.

By hand: `bench`, `gpu` and `min_versions`."""

import glob

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "examples", "docs"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    # Two workers, as in CI; arguments after `--` replace them (`nox -s tests -- -x`).
    args = session.posargs or ["-n", "2"]
    session.run("python", "-m", "pytest", *args)


# The lower bounds of `[project] dependencies`, pinned together, and the oldest optax
# that the test extra allows. Not in the default sessions (its own environment, as
# slow as `tests`): run it when a bound or the JAX/equinox APIs used change, and
# before a release.
MIN_VERSIONS = [
    "jax==0.7.2",
    "jaxlib==0.7.2",
    "equinox==0.13.1",
    "jaxtyping==0.2.33",
    "optax==0.2.4",
]
# Tests that need a newer jax than the library does: `jax.enable_x64` (jax 0.8.0)
# and `str(PartitionSpec)` written as "P(...)" (jax 0.9.1).
NEWER_JAX_TESTS = [
    "tests/test_docstrings.py::test_docstring_examples",
    "tests/test_docstrings.py::test_doc_page_examples",
    "tests/test_inputs.py::test_integer_dtype_reported_as_given",
    "tests/test_inputs.py::test_depth_beyond_int32_counter",
    "tests/test_nn_inputs.py::test_default_dtype_follows_64_bit_mode",
]


@nox.session(python="3.11")
def min_versions(session: nox.Session) -> None:
    session.install("-e", ".[test]", *MIN_VERSIONS)
    deselect = [f"--deselect={test}" for test in NEWER_JAX_TESTS]
    # Two workers, as in `tests`; arguments after `--` replace them.
    args = session.posargs or ["-n", "2"]
    session.run("python", "-m", "pytest", *deselect, *args)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("-e", ".[lint]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[typecheck]")
    # Configured in pyproject's [tool.pyright]; the env var skips pyright-python's
    # query for a newer release.
    session.run("pyright", "krylovjax", env={"PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"})


@nox.session(python="3.11")
def examples(session: nox.Session) -> None:
    session.install("-e", ".[examples]")
    for path in sorted(glob.glob("examples/*.py")):
        session.run("python", path)


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    session.install("-e", ".[bench]")
    for path in sorted(glob.glob("benchmarks/bench_*.py")):
        session.run("python", path, *session.posargs)


@nox.session(python="3.11")
def gpu(session: nox.Session) -> None:
    # The accelerator table, on JAX's default backend (`-- --fast` for a CPU smoke
    # run, as in CI). Install the jaxlib for the accelerator first.
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/gpu.py", *session.posargs)
