"""The ``qsync`` command's arguments and output: bad arguments refused up front in one line with exit
code 2, and output into a reader that stops early ending quietly."""

import os
import subprocess
import sys

import pytest

from qsync_callback.cli import main
from qsync_callback.recorder.trace import rank_trace_path

from tracebuilder import op, trace


@pytest.fixture
def trace_dir(tmp_path):
    ops = [op(i, f"aten::op{i}", "forward", "main", 10 * i, 10, layer="fc") for i in range(60)]
    t = trace(
        ops,
        step_end=600,
        layers=[{"name": "fc", "type": "Linear", "param_bytes": 4}],
        measured={"step_ms": [0.6, 0.6], "peak_bytes": 100},
    )
    t.save(rank_trace_path(tmp_path, 0))
    return tmp_path


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["plan", "--max-step-ms", "-1"],
            "--max-step-ms: expected a positive number of milliseconds, not -1",
        ),
        (["plan", "--max-step-ms", "0"], "--max-step-ms: expected a positive number of milliseconds, not 0"),
        (
            ["plan", "--max-step-ms", "nan"],
            "--max-step-ms: expected a positive number of milliseconds, not nan",
        ),
        (
            ["plan", "--max-step-ms", "inf"],
            "--max-step-ms: expected a positive number of milliseconds, not inf",
        ),
        (["plan", "--max-step-ms", "soon"], "argument --max-step-ms: invalid float value: 'soon'"),
        (["plan", "--memory-budget", "lots"], "--memory-budget: not a size: 'lots'"),
        (["plan", "--memory-budget=-5GB"], "--memory-budget: not a size: '-5GB'"),
        (["plan", "--memory-budget", "0%"], "--memory-budget: a percentage must be"),
        (["plan", "--memory-budget", "inf%"], "--memory-budget: a percentage must be"),
        (["plan", "--precisions", "fp32,fp12"], "--precisions: unknown fp12"),
        (["plan", "--precisions", ","], "--precisions: unknown none given"),
        (["report", "--top", "-3"], "--top: expected a positive number of ops, not -3"),
        (["report", "--top", "0"], "--top: expected a positive number of ops, not 0"),
        (["report", "--top", "x"], "argument --top: invalid int value: 'x'"),
    ],
)
def test_a_bad_argument_is_refused_in_one_line_before_any_trace_is_read(tmp_path, capsys, argv, expected):
    missing = str(tmp_path / "no-such-dir")  # never read: the argument is refused first
    command, *options = argv
    try:
        code = main([command, missing, *options])
    except SystemExit as exit_:  # argparse's own checks (types)
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith(f"qsync: error: {expected}") and captured.err.count("\n") == 1
    assert "no-such-dir" not in captured.err


def test_a_missing_command_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "qsync: error: the following arguments are required: command (see qsync --help)\n"


def test_good_arguments_get_as_far_as_the_trace(trace_dir, capsys):
    code = main(
        ["plan", str(trace_dir), "--max-step-ms", "5", "--memory-budget", "90%", "--precisions", "fp32"]
    )
    assert code == 2  # refused for what the trace lacks, once the arguments passed
    assert capsys.readouterr().err.startswith("qsync: error: the trace has no layer statistics")


@pytest.mark.parametrize("argv", [["report"], ["report", "--json"], ["predict", "--json"]])
def test_output_into_a_closed_pipe_ends_quietly(trace_dir, argv):
    """``qsync report DIR | head``: the reader has gone before the report is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "qsync_callback.cli", argv[0], str(trace_dir), *argv[1:]],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)
    assert result.stderr == "" and result.returncode == 0
