"""Rewrite the tables of benchmarks/README.md from the benchmarks' saved results.

The README marks each table a benchmark writes with a pair of lines::

    <!-- table: NAME -->
    ...
    <!-- /table -->

and this script replaces what lies between them with ``<results>/NAME.md`` (the table the benchmark
wrote with ``runs.write_results``) and a line naming when, at which commit, on which machine and by
which command it was measured, from the ``environment`` of ``<results>/NAME.json``. A marker whose
results are missing is left as it is and reported; a marker pair that does not close, or nests, is
an error (exit code 2) and nothing is written. Only the standard library: it runs without the venv.

    python benchmarks/readme_tables.py [--results benchmarks/results] [--readme benchmarks/README.md]
        [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OPEN = re.compile(r"^\s*<!--\s*table:\s*([A-Za-z0-9_.-]+)\s*-->\s*$")
CLOSE = re.compile(r"^\s*<!--\s*/table\s*-->\s*$")
LOOKS_LIKE_MARKER = re.compile(r"^\s*<!--\s*/?\s*table\b")  # a marker is alone on its line


class MarkerError(ValueError):
    """The README's markers do not pair up: an opening without its close, a close without an
    opening, one inside another, a name used twice, or a line that looks like a marker but is not."""


@dataclass
class Block:
    """One marked table: its name and the 0-based line numbers of its two markers."""

    name: str
    open_line: int
    close_line: int


@dataclass
class Outcome:
    """What `rewrite` did: the new text, the names replaced, those left for want of results, and
    the results files that no marker asks for."""

    text: str
    replaced: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def find_blocks(text: str, source: str = "README") -> list[Block]:
    """The marked blocks of ``text``, in order; `MarkerError` (naming ``source`` and the line) if the
    markers are malformed."""
    blocks: list[Block] = []
    seen: dict[str, int] = {}
    open_name, open_at = None, -1
    for i, line in enumerate(text.splitlines()):
        opening, closing = OPEN.match(line), CLOSE.match(line)
        if not opening and not closing:
            if LOOKS_LIKE_MARKER.match(line):
                raise MarkerError(
                    f"{source}:{i + 1}: malformed table marker {line.strip()!r}; "
                    "expected '<!-- table: NAME -->' or '<!-- /table -->' alone on the line"
                )
            continue
        if opening:
            name = opening.group(1)
            if open_name is not None:
                raise MarkerError(
                    f"{source}:{i + 1}: table marker {name!r} opens before {open_name!r} "
                    f"(line {open_at + 1}) is closed with '<!-- /table -->'"
                )
            if name in seen:
                raise MarkerError(
                    f"{source}:{i + 1}: table {name!r} is marked twice (first on line {seen[name] + 1})"
                )
            seen[name] = i
            open_name, open_at = name, i
        else:
            if open_name is None:
                raise MarkerError(f"{source}:{i + 1}: '<!-- /table -->' without a '<!-- table: NAME -->'")
            blocks.append(Block(open_name, open_at, i))
            open_name = None
    if open_name is not None:
        raise MarkerError(
            f"{source}:{open_at + 1}: table marker {open_name!r} is never closed with '<!-- /table -->'"
        )
    return blocks


def _short(value: Any, length: int = 12) -> str:
    return str(value)[:length]


def provenance_line(environment: dict[str, Any] | None) -> str:
    """The line under a table: date, commit, machine (CPUs, the CPU and its precision extensions,
    platform), TF's oneDNN setting where a TF benchmark saved it, allocator, load and command,
    from a benchmark's saved ``environment`` (None: no JSON was saved); what it did not record is
    said so."""
    if environment is None:
        return "Measured: when, where and how not recorded (no JSON beside the table)."
    date = environment.get("date") or "date not recorded"
    commit = environment.get("git_commit")
    commit_text = f"commit `{_short(commit)}`" if commit else "commit not recorded"
    cpus = environment.get("cpu_count")
    machine = f"{cpus} CPUs" if cpus else "CPU count not recorded"
    if environment.get("cpu"):
        machine += f", {environment['cpu']}"
    if environment.get("platform"):
        machine += f", {environment['platform']}"
    parts = [date, commit_text, machine]
    if "tf_enable_onednn_opts" in environment:
        onednn = environment["tf_enable_onednn_opts"]
        parts.append("TF_ENABLE_ONEDNN_OPTS" + (f"={onednn}" if onednn is not None else " unset"))
    if "tcmalloc" in environment:
        parts.append("tcmalloc preloaded" if environment["tcmalloc"] else "glibc malloc")
    load = environment.get("load_avg_at_start")
    if load:
        parts.append("load average " + "/".join(f"{x:.1f}" for x in load) + " at start")
    command = environment.get("command")
    parts.append(f"`{command}`" if command else "command not recorded")
    return "Measured: " + "; ".join(parts) + "."


def table_block(name: str, results: Path) -> list[str] | None:
    """The lines to put between ``name``'s markers, or None if ``<results>/<name>.md`` is missing."""
    table_path = results / f"{name}.md"
    if not table_path.is_file():
        return None
    json_path = results / f"{name}.json"
    environment = None
    if json_path.is_file():
        try:
            raw = json.loads(json_path.read_text())
        except ValueError as exc:
            raise ValueError(f"{json_path}: not JSON ({exc})") from None
        environment = raw.get("environment") if isinstance(raw, dict) else None
        environment = environment if isinstance(environment, dict) else {}
    table = table_path.read_text().strip("\n").splitlines()
    return ["", *table, "", provenance_line(environment), ""]


def rewrite(text: str, results: Path, source: str = "README") -> Outcome:
    """``text`` with every marked table replaced from ``results`` (see the module's docstring)."""
    blocks = find_blocks(text, source)
    lines = text.splitlines()
    outcome = Outcome(text)
    out: list[str] = []
    last = 0
    for block in blocks:
        new = table_block(block.name, results)
        out += lines[last : block.open_line + 1]
        if new is None:
            outcome.missing.append(block.name)
            out += lines[block.open_line + 1 : block.close_line]
        else:
            outcome.replaced.append(block.name)
            out += new
        last = block.close_line
    out += lines[last:]
    outcome.text = "\n".join(out) + ("\n" if text.endswith("\n") else "")
    marked = {b.name for b in blocks}
    if results.is_dir():
        outcome.unused = sorted(p.stem for p in results.glob("*.md") if p.stem not in marked)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results", help="the benchmarks' --out")
    parser.add_argument("--readme", type=Path, default=HERE / "README.md", help="the README to read")
    parser.add_argument("--output", type=Path, help="where to write it (default: the README itself)")
    args = parser.parse_args(argv)
    try:
        outcome = rewrite(args.readme.read_text(), args.results, str(args.readme))
    except (ValueError, OSError) as exc:  # MarkerError, a bad JSON, an unreadable file
        print(f"readme_tables: {exc}", file=sys.stderr)
        return 2
    output = args.output or args.readme
    output.parent.mkdir(parents=True, exist_ok=True)
    if not output.exists() or output.read_text() != outcome.text:
        output.write_text(outcome.text)
    print(f"readme_tables: wrote {output} from {args.results}")
    print(f"  replaced ({len(outcome.replaced)}): {', '.join(outcome.replaced) or '-'}")
    if outcome.missing:
        print(
            f"  left as they were, no results ({len(outcome.missing)}): {', '.join(outcome.missing)}",
            file=sys.stderr,
        )
    outcome.unused = [n for n in outcome.unused if args.results / f"{n}.md" != output]  # our own output
    if outcome.unused:
        print(f"  results with no marker in the README: {', '.join(outcome.unused)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
