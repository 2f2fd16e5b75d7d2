"""The README's config reference is generated from the schemas and documents every field."""

import dataclasses
import os
import typing

import pytest

from launch import docs
from rl import config as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _walk(cls: type, prefix: str = ""):
    """(dotted path, field, is_section) of every schema field, sections included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        section = dataclasses.is_dataclass(hints[f.name])
        yield path, f, section
        if section:
            yield from _walk(hints[f.name], path)


def _cells(row: str) -> list[str]:
    """The cells of a markdown table row (escaped pipes stay inside their cell)."""
    inner = row.strip()[1:-1].replace("\\|", "\0")
    return [c.strip().replace("\0", "\\|") for c in inner.split("|")]


def test_every_schema_field_has_help():
    missing = [p for p, f, _ in _walk(C.RunConfig) if not f.metadata.get("help", "").strip()]
    assert missing == [], f"schema fields without a help string: {missing}"


def test_table_has_one_row_per_leaf_field():
    leaves = [p for p, _, section in _walk(C.RunConfig) if not section]
    assert len(leaves) > 50  # the walk really reached the nested sections
    rows = docs.config_reference_markdown().strip().splitlines()
    assert rows[0] == "| Key | Type | Default | Meaning |"
    body = rows[2:]
    assert [_cells(r)[0] for r in body] == [f"`{p}`" for p in leaves]
    assert all(len(_cells(r)) == 4 for r in body)


def test_table_rows_by_hand():
    rows = {_cells(r)[0]: _cells(r) for r in docs.config_reference_markdown().splitlines()[2:]}
    assert rows["`optim.lr`"] == [
        "`optim.lr`",
        "float",
        "`0.0003`",
        "peak learning rate of the RL stage",
    ]
    assert rows["`algorithm.clip_eps_high`"][1:3] == ["float or null", "`null`"]
    assert rows["`rollout.vllm.urls`"][1:3] == ["list[str]", "`[]`"]
    assert rows["`model.path`"][2] == "`''`"
    # "<run_root>/<name>" would vanish as an HTML tag; it is escaped.
    assert rows["`name`"][3] == "run name; the run directory is &lt;run_root>/&lt;name>"
    assert rows["`trainer.mode`"][1] == "one of 'sync', 'one_step_off', 'async'"


def test_write_then_check(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text(f"# Title\n\nintro\n\n{docs.START}\nstale\n{docs.END}\n\n## After\n")
    assert docs.main(["--check", str(path)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert docs.main(["--write", str(path)]) == 0
    text = path.read_text()
    assert text.startswith("# Title\n\nintro\n\n")
    assert text.endswith("\n\n## After\n")
    assert docs.current_block(text) == docs.render_block()
    assert docs.config_reference_markdown() in text
    assert docs.main(["--check", str(path)]) == 0
    path.write_text(text.replace("peak learning rate", "peak learning-rate"))
    assert docs.main(["--check", str(path)]) == 1


def test_added_field_makes_check_fail(tmp_path, monkeypatch):
    path = tmp_path / "README.md"
    path.write_text(f"{docs.START}\n{docs.END}\n")
    assert docs.main(["--write", str(path)]) == 0
    rows = C.reference_rows()
    monkeypatch.setattr(C, "reference_rows", lambda: [*rows, ("optim.new", "int", "0", "new")])
    assert docs.main(["--check", str(path)]) == 1


def test_missing_markers_are_an_error(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text("# no markers\n")
    assert docs.main(["--check", str(path)]) == 2
    assert "config-reference:start" in capsys.readouterr().err
    with pytest.raises(ValueError, match="missing"):
        docs.replace_block("# no markers\n")


def test_readme_block_is_current():
    assert os.path.exists(README), f"{README} is missing"
    with open(README) as f:
        text = f.read()
    assert docs.START in text and docs.END in text, f"README.md lacks {docs.START} / {docs.END}"
    assert docs.current_block(text) == docs.render_block(), (
        "README.md's config reference is stale: run `python -m launch.docs --write README.md`"
    )
