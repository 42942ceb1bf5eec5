"""Run every docstring example of the public modules as a doctest.

One test per module: the examples must pass, and every public name the module defines
(re-exported by `krylovjax` or `krylovjax.nn`) must carry at least one example, so a
docstring without an example fails here. Docstring outputs are written for JAX's
default float32, so the examples run with 64-bit mode switched off even when
`conftest.py` enables it for the gradient checks.
"""

import doctest
import importlib
import pkgutil
import types

import jax
import pytest

import krylovjax

CORE_MODULES = ["krylovjax._krylov", "krylovjax._iterate"]
OPTIONFLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _nn_package() -> types.ModuleType | None:
    try:
        return importlib.import_module("krylovjax.nn")
    except ModuleNotFoundError:
        return None


def _module_names() -> list[str]:
    names = list(CORE_MODULES)
    nn = _nn_package()
    if nn is not None:
        names.append(nn.__name__)
        names.extend(
            info.name
            for info in pkgutil.walk_packages(nn.__path__, prefix=f"{nn.__name__}.")
        )
    return names


def _public_objects(module: types.ModuleType) -> dict[str, object]:
    """Public names (from the packages' `__all__`) whose home is `module`."""
    packages = [krylovjax]
    nn = _nn_package()
    if nn is not None:
        packages.append(nn)
    public = {}
    for package in packages:
        for name in package.__all__:
            obj = getattr(package, name)
            if getattr(obj, "__module__", None) == module.__name__:
                public[f"{package.__name__}.{name}"] = obj
    return public


def _run(tests: list[doctest.DocTest]) -> tuple[doctest.TestResults, str]:
    lines: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    with jax.enable_x64(False):
        for test in tests:
            runner.run(test, out=lines.append)
    return runner.summarize(verbose=False), "".join(lines)


def test_module_list_covers_core() -> None:
    names = _module_names()
    assert set(CORE_MODULES) <= set(names)
    for package in ("krylovjax", "krylovjax.nn"):
        if package == "krylovjax" or _nn_package() is not None:
            exported = importlib.import_module(package).__all__
            homes = {
                getattr(importlib.import_module(package), n).__module__
                for n in exported
            }
            assert homes <= set(names), homes - set(names)


@pytest.mark.parametrize("module_name", _module_names())
def test_docstring_examples(module_name: str) -> None:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder()
    results, output = _run(finder.find(module, module_name))
    assert results.failed == 0, output

    public = _public_objects(module)
    without_example = [
        name
        for name, obj in public.items()
        if sum(len(t.examples) for t in finder.find(obj, name, module=module)) == 0
    ]
    assert not without_example, (
        f"public names without a docstring example: {without_example}"
    )
