"""The config reference in docs/configuration.md, generated from the schemas: --check or --write it.

python -m launch.docs --check docs/configuration.md   (exit 1 when its block is out of date)
python -m launch.docs --write docs/configuration.md   (regenerate the block between the markers)
"""

from __future__ import annotations

import argparse
import difflib
import sys

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
REFERENCE = "docs/configuration.md"
NOTE = f"<!-- generated from rl/config.py by `python -m launch.docs --write {REFERENCE}` -->"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell: one line; pipes, tags and stars escaped."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def config_reference_markdown() -> str:
    """A markdown table of every config key: key, type, default and meaning."""
    from rl.config import reference_rows

    lines = ["| Key | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for key, type_name, default, meaning in reference_rows():
        default = " ".join(default.split()).replace("|", "\\|")  # code span: only pipes
        lines.append(f"| `{key}` | {_cell(type_name)} | `{default}` | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def render_block() -> str:
    """The whole generated block, markers included."""
    return f"{START}\n{NOTE}\n\n{config_reference_markdown()}{END}"


def _find_block(text: str, path: str) -> tuple[int, int]:
    """(start, end) offsets of the marked block in `text`, markers included."""
    start = text.find(START)
    end = text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(
            f"{path}: the config reference markers are missing or out of order; add the two "
            f"lines {START!r} and {END!r} where the table belongs"
        )
    if text.count(START) > 1 or text.count(END) > 1:
        raise ValueError(f"{path}: the config reference markers appear more than once")
    return start, end + len(END)


def current_block(text: str, path: str = REFERENCE) -> str:
    """The marked block of a document, markers included."""
    start, end = _find_block(text, path)
    return text[start:end]


def replace_block(text: str, path: str = REFERENCE) -> str:
    """The document with its marked block replaced by the generated one."""
    start, end = _find_block(text, path)
    return text[:start] + render_block() + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Checks or rewrites the config reference block of a markdown file."""
    parser = argparse.ArgumentParser(prog="python -m launch.docs", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", metavar="FILE", help="exit 1 if FILE's block is out of date")
    group.add_argument("--write", metavar="FILE", help="regenerate FILE's block in place")
    args = parser.parse_args(argv)
    path = args.check or args.write
    try:
        with open(path) as f:
            text = f.read()
        new = replace_block(text, path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.write:
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"{path}: config reference updated")
        else:
            print(f"{path}: config reference already up to date")
        return 0
    if new == text:
        print(f"{path}: config reference up to date")
        return 0
    diff = difflib.unified_diff(
        current_block(text, path).splitlines(),
        render_block().splitlines(),
        f"{path} (current)",
        "generated",
        lineterm="",
    )
    print("\n".join(diff))
    print(
        f"{path}: config reference is out of date; run `python -m launch.docs --write {path}`",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
