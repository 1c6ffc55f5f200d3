"""benchmarks/readme_tables.py: marked tables replaced from the results with the line that says how
they were measured, a marker without results left as it was, and malformed markers refused."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "readme_tables.py"
_spec = importlib.util.spec_from_file_location("readme_tables", SCRIPT)
readme_tables = importlib.util.module_from_spec(_spec)
sys.modules["readme_tables"] = readme_tables  # its dataclasses look their module up
_spec.loader.exec_module(readme_tables)

README = """# Benchmarks

Prose that stays, and names the markers, `<!-- table: NAME -->` and `<!-- /table -->`, in passing.

<!-- table: alpha -->
| old | table |
|---|---|
| 1 | 2 |
<!-- /table -->

More prose.

<!-- table: beta -->
| beta's old table, no results for it |
<!-- /table -->
"""

ENVIRONMENT = {
    "date": "2026-11-25T10:00:00+00:00",
    "git_commit": "0123456789abcdef0123456789abcdef01234567",
    "cpu_count": 2,
    "cpu": "AMD EPYC (avx2 fma f16c; no AVX-512)",
    "platform": "Linux-6.1-x86_64-with-glibc2.36",
    "tcmalloc": None,
    "load_avg_at_start": [0.1, 0.2, 0.3],
    "command": "python benchmarks/alpha.py --out benchmarks/results",
}


@pytest.fixture
def results(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "alpha.md").write_text("| new | table |\n|---|---|\n| 3 | 4 |\n")
    (out / "alpha.json").write_text(json.dumps({"environment": ENVIRONMENT, "rows": []}))
    (out / "gamma.md").write_text("| no marker asks for this |\n")
    return out


def test_marked_table_is_replaced_with_its_results_and_how_they_were_measured(results):
    outcome = readme_tables.rewrite(README, results)
    assert outcome.replaced == ["alpha"]
    text = outcome.text
    assert "| 3 | 4 |" in text and "| 1 | 2 |" not in text
    block = text[text.index("\n<!-- table: alpha -->") : text.index("\n<!-- /table -->")]
    line = block.strip().splitlines()[-1]
    for part in ("2026-11-25", "0123456789ab", "2 CPUs", "Linux-6.1", "glibc malloc", ENVIRONMENT["command"]):
        assert part in line
    assert "2 CPUs, AMD EPYC (avx2 fma f16c; no AVX-512), Linux-6.1" in line and "ONEDNN" not in line
    assert "Prose that stays, and names the markers" in text and "More prose." in text
    # run again on its own output: the same text (the block is replaced, not appended to)
    assert readme_tables.rewrite(text, results).text == text


def test_a_tensorflow_benchmarks_line_names_its_onednn_setting():
    """TF measures no CPU peak without oneDNN, and leaves it off by itself on some CPUs."""
    assert "; TF_ENABLE_ONEDNN_OPTS=1;" in readme_tables.provenance_line(
        {**ENVIRONMENT, "tf_enable_onednn_opts": "1"}
    )
    assert "; TF_ENABLE_ONEDNN_OPTS unset;" in readme_tables.provenance_line(
        {**ENVIRONMENT, "tf_enable_onednn_opts": None}
    )


def test_marker_without_results_is_left_as_it_is_and_reported(results, tmp_path, capsys):
    outcome = readme_tables.rewrite(README, results)
    assert outcome.missing == ["beta"]
    assert "| beta's old table, no results for it |" in outcome.text
    assert outcome.unused == ["gamma"]
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert readme_tables.main(["--results", str(results), "--readme", str(readme)]) == 0
    err = capsys.readouterr().err
    assert "beta" in err and "gamma" in err
    assert "| 3 | 4 |" in readme.read_text() and "beta's old table" in readme.read_text()


def test_a_table_without_its_json_says_so(results):
    (results / "alpha.json").unlink()
    text = readme_tables.rewrite(README, results).text
    assert "| 3 | 4 |" in text and "not recorded (no JSON beside the table)" in text


def test_every_benchmark_has_a_marker_in_the_readme_and_runs_in_make_bench():
    """benchmarks/README.md's markers pair up, and name exactly the benchmark scripts (those with a
    ``main``), which are exactly the Makefile's BENCHMARKS."""
    benchmarks = SCRIPT.parent
    scripts = {
        p.stem
        for p in benchmarks.glob("*.py")
        if p.stem not in ("runs", "readme_tables") and "def main(" in p.read_text()
    }
    blocks = readme_tables.find_blocks((benchmarks / "README.md").read_text(), "benchmarks/README.md")
    assert {b.name for b in blocks} == scripts
    makefile = (benchmarks.parent / "Makefile").read_text().replace("\\\n", " ")
    listed = next(line for line in makefile.splitlines() if line.startswith("BENCHMARKS :="))
    assert set(listed.split(":=", 1)[1].split()) == scripts


@pytest.mark.parametrize(
    "markers, message",
    [
        ("<!-- table: alpha -->\n| x |\n", "'alpha' is never closed"),
        ("<!-- table: alpha -->\n<!-- table: beta -->\n<!-- /table -->\n", "opens before 'alpha'"),
        ("| x |\n<!-- /table -->\n", "without a '<!-- table: NAME -->'"),
        ("<!-- table alpha -->\n<!-- /table -->\n", "malformed table marker"),
        ("<!-- table: a -->\n<!-- /table -->\n<!-- table: a -->\n<!-- /table -->\n", "marked twice"),
    ],
)
def test_malformed_markers_are_a_clear_error_and_nothing_is_written(
    markers, message, results, tmp_path, capsys
):
    with pytest.raises(readme_tables.MarkerError, match=message):
        readme_tables.rewrite("# t\n" + markers, results, "README.md")
    readme = tmp_path / "README.md"
    readme.write_text("# t\n" + markers)
    assert readme_tables.main(["--results", str(results), "--readme", str(readme)]) == 2
    err = capsys.readouterr().err
    assert message in err and f"{readme}:" in err  # names the file and the line
    assert readme.read_text() == "# t\n" + markers
