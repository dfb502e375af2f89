"""The Python API as the README documents it: every name it shows is exported, typed, and resolves."""
import inspect
import re
from pathlib import Path

import tritonpack

README = Path(__file__).resolve().parent.parent / "README.md"


def _documented() -> set[str]:
    """The ``tritonpack.X`` names and classes the README's "Python API" section shows."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    section = section[:section.index("\n## ", 1)]
    names = set(re.findall(r"tritonpack\.([A-Za-z_]\w*)", section))
    names |= set(re.findall(r"\b([A-Z]\w*(?:Result|Report|Error|Info))\b", section))
    return names | {"Entry", "Terminated"}


def test_every_documented_name_is_exported():
    assert _documented() - set(tritonpack.__all__) == set()


def test_every_exported_name_resolves():
    for name in tritonpack.__all__:
        assert getattr(tritonpack, name) is not None, name
    assert (Path(tritonpack.__file__).parent / "py.typed").is_file()


def test_exported_functions_are_annotated():
    for name in tritonpack.__all__:
        value = getattr(tritonpack, name)
        if not inspect.isfunction(value):
            continue
        signature = inspect.signature(value)
        assert signature.return_annotation is not inspect.Signature.empty, name
        unannotated = [p for p, q in signature.parameters.items() if q.annotation is inspect.Parameter.empty]
        assert unannotated == [], name
