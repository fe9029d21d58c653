"""The real-model rows' and the grid's helpers of `benchmarks.kernels` (the timings themselves need a GPU)."""

from __future__ import annotations

import pytest

from benchmarks.kernels import grid_verdict, mixed_lengths, parse_grid_sizes, real_floors, real_verdict


def test_mixed_lengths_are_deterministic_documents_summing_to_the_total():
    a, b = mixed_lengths(32768), mixed_lengths(32768)
    assert a == b and sum(a) == 32768 and len(a) > 8
    assert min(a) >= 1 and max(a) <= 8192
    assert sum(n % 64 == 0 for n in a) < len(a) // 4  # mostly partial last chunks


def test_real_floors_count_grouped_heads_and_per_sequence_states():
    dense = real_floors([4096], 16, 32, 128, 128, 1)
    packed = real_floors([4000, 96], 16, 32, 128, 128, 1)
    assert packed[0] > dense[0]  # two sequences: one more final state and one more partial chunk boundary
    wider_keys = real_floors([4096], 32, 32, 128, 128, 1)
    assert wider_keys[0] > dense[0] and wider_keys[1] == dense[1]  # q, k read per key head; FLOPs per value head


def _row(shape, o_final, strict, varlen=False, first=2.0):
    return dict(shape=shape, B=8, T=4096, varlen=varlen, speedup_o_final_vs_fla=o_final, speedup_vs_fla=strict,
                first_call_ours_s=first)


def test_real_verdict_judges_the_outputs_fla_returns_and_counts_the_misses():
    rows = [_row("GDN", 1.15, 0.89), _row("Qwen", 1.37, 1.18, varlen=True, first=9.1), _row("DP", 1.77, 1.52)]
    line = real_verdict(rows)
    assert "NOT MET at 1 of 3 rows" in line and "worst 1.15x: GDN B=8 T=4096" in line
    assert "fp32 boundary states too, worst 0.89x" in line and "slowest first call of ours 9.1 s" in line
    assert "MET (worst 1.37x: Qwen varlen)" in real_verdict(rows[1:])
    nan = float("nan")
    assert "not judged" in real_verdict([_row("GDN", nan, nan)])


def _point(B, n_h, gate, o_final, strict):
    return dict(B=B, T=8192, n_h=n_h, gate=gate, speedup_o_final_vs_fla=o_final, speedup_vs_fla=strict)


def test_grid_verdict_judges_the_outputs_fla_returns_and_names_the_worst_point():
    rows = [_point(1, 3, False, 1.12, 0.95), _point(8, 1, True, 1.95, 1.60), _point(1, 1, True, 1.25, 1.01)]
    line = grid_verdict(rows)
    assert "NOT MET at 2 of 3 points" in line and "worst 1.12x: B=1 T=8192 n_h=3 gate off" in line
    assert "fp32 boundary states too, worst 0.95x" in line
    assert "MET (worst 1.95x: B=8 T=8192 n_h=1 gate on)" in grid_verdict(rows[1:2])
    nan = float("nan")
    assert "not judged" in grid_verdict([_point(1, 1, True, nan, nan)])


def test_grid_sizes_parse_pairs_and_refuse_points_off_the_grid():
    assert parse_grid_sizes("1x8192,8x2048") == {(1, 8192), (8, 2048)}
    with pytest.raises(ValueError, match="not on the grid"):
        parse_grid_sizes("4x8192")
    with pytest.raises(ValueError, match="BxT pairs"):
        parse_grid_sizes("8-2048")


def test_time_interleaved_takes_turns_and_keeps_each_sides_fastest():
    from benchmarks.kernels import time_interleaved

    calls: list[str] = []
    slow_spell = iter([5.0, 5.0, 5.0, 1.0, 2.0, 3.0])  # the host slows down the first round for everyone

    def timer(fn):
        calls.append(fn())
        return next(slow_spell)

    got = time_interleaved(dict(ours=lambda: "ours", lean=lambda: "lean", fla=lambda: "fla"), rounds=2, timer=timer)
    assert calls == ["ours", "lean", "fla"] * 2  # turns, not one side's rounds back to back
    assert got == dict(ours=1.0, lean=2.0, fla=3.0)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        time_interleaved(dict(ours=lambda: None), rounds=0, timer=timer)


def test_rounds_below_one_is_a_one_line_cli_error(capsys):
    from benchmarks.kernels import main

    with pytest.raises(SystemExit) as exc:
        main(["--rounds", "0"])
    assert exc.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
