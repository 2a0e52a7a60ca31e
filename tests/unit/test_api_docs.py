"""docs/api.md is what tools/api_docs.py makes from the docstrings: the page cannot drift."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api_docs():
    spec = importlib.util.spec_from_file_location("api_docs", REPO / "tools" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_api_md_equals_the_generators_output(api_docs):
    assert (REPO / "docs" / "api.md").read_text() == api_docs.render(), (
        "docs/api.md is out of date: run python tools/api_docs.py")


def test_every_public_name_and_method_is_on_the_page(api_docs):
    import multigpu

    page = api_docs.render()
    for name in multigpu.__all__:
        assert f"`{name}(" in page or f"class `{name}" in page, name
    for method in ["Runtime.prepare(", "Runtime.save(", "Runtime.load(", "Runtime.backward(",
                   "Runtime.step(", "Precision.autocast(", "DistEnv.all_reduce(", "Sums.reduce("]:
        assert f"`{method}" in page, method


def test_docstring_text_becomes_markdown(api_docs):
    doc = ("Does a thing.\n\nx:    the input\n      continued\nNot an argument: prose.\n\n"
           "    code()\n        more()\n\nAfter.")
    assert api_docs.to_markdown(doc, {"x"}) == (
        "Does a thing.\n\n- x:    the input\n      continued\n\nNot an argument: prose.\n\n"
        "```\ncode()\n    more()\n```\n\nAfter.")


def test_a_missing_docstring_stops_the_generator_naming_it(api_docs):
    def undocumented():
        pass

    with pytest.raises(SystemExit, match="api_docs: thing has no docstring"):
        api_docs.doc_of(undocumented, "thing")
