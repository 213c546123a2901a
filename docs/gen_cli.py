"""Regenerate the option reference in docs/cli.md from the ``seqify`` command's own argparse parser.

    python docs/gen_cli.py            # rewrite the generated blocks of docs/cli.md
    python docs/gen_cli.py --check    # exit 1 if docs/cli.md differs from what the parser gives

Each command's section holds one generated block between ``<!-- seqify-cli COMMAND -->`` and
``<!-- end seqify-cli -->``: the usage line and a table of every option with its help and default. The prose
around the blocks is written by hand.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"
BLOCK = re.compile(r"(<!-- seqify-cli (?P<name>[\w-]*) -->\n)(?P<body>.*?)(<!-- end seqify-cli -->)", re.S)
WIDTH = "100"  # usage lines wrap at this width whatever the terminal


def _parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    from seqify.tools.cli import _parser as parser

    return parser()


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    if action.metavar:
        metavar = str(action.metavar)
    elif action.choices:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.dest.upper()
    if action.nargs in ("+", "*"):
        metavar += " ..."
    return f"{names} `{metavar}`"


def _default(action: argparse.Action) -> str:
    if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    value = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else str(action.default)
    return f"`{value}`"


def block(parser: argparse.ArgumentParser) -> str:
    """The generated Markdown for one parser: usage, then the option table."""
    first, *rest = parser.format_usage().strip().removeprefix("usage: ").splitlines()
    usage = "\n".join([first, *(line.removeprefix(" " * len("usage: ")) for line in rest)])
    lines = ["```text", usage, "```", ""]
    rows = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if rows:
        lines += ["| option | what it does | default |", "|---|---|---|"]
        for action in rows:
            text = _cell(action.help or "")
            if action.required and action.option_strings:
                text = f"required. {text}".strip()
            lines.append(f"| {_option(action)} | {text} | {_default(action)} |")
        lines.append("")
    return "\n".join(lines)


def render(text: str) -> str:
    os.environ["COLUMNS"] = WIDTH
    parser = _parser()
    commands = _commands(parser)

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name and name not in commands:
            raise SystemExit(f"docs/cli.md: seqify has no command {name!r} (it has {', '.join(commands)})")
        return match.group(1) + block(commands[name] if name else parser) + match.group(4)

    out = BLOCK.sub(replace, text)
    missing = sorted(set(commands) - {m["name"] for m in BLOCK.finditer(text)})
    if missing:
        raise SystemExit(f"docs/cli.md: no generated block for {', '.join(missing)}: add a section with "
                         f"'<!-- seqify-cli NAME -->' and '<!-- end seqify-cli -->'")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is not what the parser gives")
    args = p.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), "docs/cli.md",
                                                       "generated"))
            print("docs/cli.md is out of date: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        print("docs/cli.md matches the parser")
        return 0
    if new != text:
        DOC.write_text(new)
        print("wrote docs/cli.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
