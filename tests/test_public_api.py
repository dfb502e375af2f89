"""The Python API as the README documents it: every name it shows is exported, typed, and resolves."""
import inspect
import re
from pathlib import Path

import pytest
from conftest import FIXTURES

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


def test_a_path_with_a_nul_character_is_a_usage_error(tmp_path):
    """Python's ValueError ("embedded null byte") escaped every function: a program catching TpackError missed it."""
    archive = FIXTURES / "archives" / "triton-3.9.0.tpack"
    calls = [lambda: tritonpack.unpack("a\0b", tmp_path), lambda: tritonpack.unpack(archive, f"{tmp_path}/\0"),
             lambda: tritonpack.pack(f"{tmp_path}/\0", tmp_path / "k.tpack"),
             lambda: tritonpack.pack(tmp_path, f"{tmp_path}/k\0.tpack"), lambda: tritonpack.check("a\0b"),
             lambda: tritonpack.ensure(archive, f"{tmp_path}/\0"), lambda: tritonpack.verify(f"{tmp_path}/\0")]
    for call in calls:
        with pytest.raises(tritonpack.UsageError, match="NUL character"):
            call()
