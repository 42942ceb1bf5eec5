"""Run every docstring example of the public modules as a doctest.

One test per module: the examples must pass, and every public name the module defines
(re-exported by `krylovjax` or `krylovjax.nn`) must carry at least one example, so a
docstring without an example fails here. Docstring outputs are written for JAX's
default float32, so the examples run with 64-bit mode switched off even when
`conftest.py` enables it for the gradient checks.
"""

import doctest
import importlib
import pathlib
import pkgutil
import re
import types
import typing

import jax
import pytest

import krylovjax

CORE_MODULES = [
    "krylovjax._krylov",
    "krylovjax._bases",
    "krylovjax._spectrum",
    "krylovjax._iterate",
    "krylovjax._arnoldi",
    "krylovjax._lanczos",
    "krylovjax._block",
    "krylovjax._funm",
    "krylovjax._trace",
    "krylovjax._readout",
    "krylovjax._partition",
]
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
# Hand-written pages whose ```python blocks are doctest sessions.
DOC_PAGES = ["quickstart.md"]
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


def _packages() -> list[types.ModuleType]:
    nn = _nn_package()
    return [krylovjax] if nn is None else [krylovjax, nn]


def _is_type_alias(obj: object) -> bool:
    # `OperatorLike` and the like: a `Union` object at run time, with neither a home
    # module nor a docstring of its own.
    return typing.get_origin(obj) is not None


def _exported() -> dict[str, object]:
    """Every public name of `krylovjax` and `krylovjax.nn` except subpackages and
    type aliases."""
    return {
        f"{package.__name__}.{name}": getattr(package, name)
        for package in _packages()
        for name in package.__all__
        if not isinstance(getattr(package, name), types.ModuleType)
        and not _is_type_alias(getattr(package, name))
    }


def _public_objects(module: types.ModuleType) -> dict[str, object]:
    """Public names whose home is `module`."""
    return {
        name: obj
        for name, obj in _exported().items()
        if getattr(obj, "__module__", None) == module.__name__
    }


def _run(tests: list[doctest.DocTest]) -> tuple[doctest.TestResults, str]:
    lines: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    with jax.enable_x64(False):
        for test in tests:
            runner.run(test, out=lines.append)
    return runner.summarize(verbose=False), "".join(lines)


def test_every_public_name_lives_in_a_tested_module() -> None:
    names = set(_module_names())
    homes = {name: obj.__module__ for name, obj in _exported().items()}
    untested = {name: home for name, home in homes.items() if home not in names}
    assert not untested, untested


def test_every_public_type_alias_is_documented() -> None:
    # Their docstrings exist only in the source, for the API pages to render.
    pages = "".join(path.read_text() for path in (DOCS / "api").glob("*.md"))
    aliases = [
        f"{package.__name__}.{name}"
        for package in _packages()
        for name in package.__all__
        if _is_type_alias(getattr(package, name))
    ]
    assert aliases
    missing = [name for name in aliases if f"::: {name}\n" not in pages]
    assert not missing, missing


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


@pytest.mark.parametrize("page", DOC_PAGES)
def test_doc_page_examples(page: str) -> None:
    """The `>>>` sessions of a docs page run in order, sharing one namespace."""
    text = (DOCS / page).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)
    sessions = [block for block in blocks if block.lstrip().startswith(">>>")]
    assert sessions, f"no doctest sessions found in docs/{page}"
    test = doctest.DocTestParser().get_doctest(
        "\n".join(sessions), {}, f"docs/{page}", str(DOCS / page), 0
    )
    results, output = _run([test])
    assert results.failed == 0, output
    assert results.attempted == len(test.examples) > 0
