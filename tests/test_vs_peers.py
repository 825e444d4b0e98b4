"""benchmarks.vs_peers without the peers: its --help, its argument errors, and the row machinery (alternation,
per-round ratios, medians, the table) on two trivial commands. No timing is asserted."""
import sys

import pytest

from benchmarks import vs_peers


def test_help_names_every_row_and_the_checkouts(capsys):
    with pytest.raises(SystemExit) as exit_:
        vs_peers.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert all(name in out for name in (*vs_peers.ROWS, "--dit-repo", "--timm-repo", "dit_sample_shim.py"))


@pytest.mark.parametrize("argv, fragment", [
    (["--rows", "sample,speed"], "--rows speed: choose from sample, evaluate, train, fid"),
    (["--rows", "sample"], "row sample needs --dit-repo"),
    (["--rows", "evaluate,train"], "row evaluate, train needs --timm-repo"),
    (["--rows", "sample", "--dit-repo", "/nonexistent"], "--dit-repo /nonexistent: no sample.py there"),
    (["--rows", "fid", "--rounds", "0"], "--rounds 0: must be positive"),
    (["--rows", "fid", "--train-warmup", "40"], "--train-warmup 40: must leave at least two"),
])
def test_argument_errors_name_the_problem_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        vs_peers.parse_args(argv)
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err


def test_row_alternates_flips_and_reports_per_round_ratios(tmp_path, capsys):
    log = tmp_path / "order"
    side = lambda name: [sys.executable, "-c", f"open({str(log)!r}, 'a').write({name!r})"]  # noqa: E731
    env = vs_peers.environment(1, [])
    row = vs_peers.Row("trivial", "peer cmd", "runs/s", vs_peers.command_rate(1, side("o"), env),
                       vs_peers.command_rate(1, side("p"), env), "python -c ...")
    result = vs_peers.measure_row(row, rounds=3)
    assert log.read_text() == "oppoop"  # ours first, then the order flips every round
    assert len(result["ratios"]) == 3 and all(r > 0 for r in result["ratios"])
    assert result["ratio"] == sorted(result["ratios"])[1]  # the median of the per-round ratios
    vs_peers.print_table([result])
    out = capsys.readouterr().out
    assert out.count("trivial round") == 3 and "median of 3 rounds" in out
    assert "| measure | peer | ratio (ours/peer) |" in out and "| trivial | peer cmd |" in out


def test_row_command_reruns_the_row_with_the_options_given(tmp_path):
    (tmp_path / "sample.py").write_text("")
    a = vs_peers.parse_args(["--rows", "sample,fid", "--dit-repo", str(tmp_path), "--rounds", "3", "--steps", "20"])
    assert vs_peers.row_command(a, "sample") == \
        f"python -m benchmarks.vs_peers --rows sample --dit-repo {tmp_path} --rounds 3 --steps 20"
    assert vs_peers.row_command(a, "fid") == "python -m benchmarks.vs_peers --rows fid --rounds 3 --steps 20"


def test_failing_command_stops_with_its_output(tmp_path):
    failing = vs_peers.command_rate(1, [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"],
                                    vs_peers.environment(1, []))
    with pytest.raises(SystemExit, match=r"failed \(exit 3\)") as exit_:
        failing()
    assert "broken" in str(exit_.value)
