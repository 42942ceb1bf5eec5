"""Sessions that mirror CI: `nox -s tests lint typecheck examples docs bench`."""

import glob

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "examples", "docs"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    # Two workers, as in CI; arguments after `--` replace them (`nox -s tests -- -x`).
    args = session.posargs or ["-n", "2"]
    session.run("python", "-m", "pytest", *args)


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
