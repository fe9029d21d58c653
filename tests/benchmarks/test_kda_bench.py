"""`python -m benchmarks.kda` prints one row per shape and stops starting rows once its --budget seconds are used up."""

from __future__ import annotations

import benchmarks.kda as kda


def test_rows_print_and_budget_stops(monkeypatch, capsys):
    monkeypatch.setattr(kda, "K", 16)
    monkeypatch.setattr(kda, "V", 16)
    monkeypatch.setattr(kda, "GRID", dict(B=(1,), T=(70,), H=(2, 3)))
    kda.main(["--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split()[:2] == ["1", "70"]]
    assert [r[2] for r in rows] == ["2", "3"]
    assert all(float(r[-2]) < 1e-2 for r in rows)  # ours (bf16 inputs) vs the float32 chunked form
    kda.main(["--device", "cpu", "--budget", "0"])
    out = capsys.readouterr().out
    assert "rows not run: [(1, 70, 2), (1, 70, 3)]" in out


def test_shape_picks_rows_and_bad_shape_is_one_line(monkeypatch, capsys):
    import pytest

    monkeypatch.setattr(kda, "K", 16)
    monkeypatch.setattr(kda, "V", 16)
    kda.main(["--device", "cpu", "--shape", "1,40,2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["1", "40"]]
    assert [r[2] for r in rows] == ["2"]
    with pytest.raises(SystemExit):
        kda.main(["--device", "cpu", "--shape", "1,40"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "give B,T,H as three integers" in err[-1]
