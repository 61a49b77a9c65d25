"""The checked-in `docs/config_reference.md` matches the config dataclasses."""

import dataclasses

from tools import gen_config_reference as gen


def test_checked_in_reference_is_current():
    current = gen.OUTPUT.read_text() if gen.OUTPUT.exists() else ""
    assert current == gen.render(), (
        f"{gen.OUTPUT.relative_to(gen.ROOT)} is out of date with decoupled_diloco/config.py; "
        f"regenerate it with: .venv/bin/{gen.COMMAND}"
    )


def test_every_field_is_documented():
    assert gen.undocumented() == [], (
        "describe these fields in their class docstring's `Attributes:` section, then run "
        f".venv/bin/{gen.COMMAND}"
    )


def test_reference_lists_every_flag_with_its_default():
    text = gen.render()
    for prefix, cls in gen.sections():
        for field in dataclasses.fields(cls):
            assert f"| `{prefix}{field.name}` |" in text
    assert "| `decoupled.quorum` | int | `1` |" in text
    assert "| `mesh.shape` | tuple[int, int] | `(1, 1)` |" in text


def test_attributes_parser_handles_continuations_and_other_sections():
    class Example:
        """Summary line.

        More summary.

        Attributes:
          a: first, which goes on
            over two lines.
          b (int): second.

        Raises:
          ValueError: not an attribute.
        """

    summary, docs = gen.split_docstring(Example)
    assert summary == "Summary line.\n\nMore summary."
    assert docs == {"a": "first, which goes on over two lines.", "b": "second."}
