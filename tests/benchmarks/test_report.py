"""`python -m benchmarks.report`: docs/benchmarks.md's tables from a `benchmarks.kernels --json` file."""

from __future__ import annotations

import json

from benchmarks.report import main


def _run(**extra) -> dict:
    run = dict(device="Test GPU", torch="2.11+cu130", triton="3.6.0", fla="fla 0.6.0", started="2026-11-28 20:00:00")
    run.update(extra)
    return run


def _forward_rows() -> list[dict]:
    rows = []
    for (B, T), ratios in {(1, 2048): (2.5, 3.5), (8, 8192): (1.7, 1.25)}.items():
        for gate, r in zip((False, True), ratios):
            rows.append(dict(B=B, T=T, H=8, K=128, V=128, n_h=1, gate=gate, speedup_o_final_vs_fla=r,
                             ours_o_final_ms=0.4, fla_ms=0.4 * r))
    return rows


def _report(tmp_path, capsys, *runs: dict) -> tuple[int, str, str]:
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    rc = main([str(p) for p in paths])
    out, err = capsys.readouterr()
    return rc, out, err


def test_grid_table_has_one_cell_per_point_and_names_the_worst(tmp_path, capsys):
    rc, out, _ = _report(tmp_path, capsys, _run(cuda="13.0", commit="abc1234", forward=_forward_rows()))
    assert rc == 0
    assert "| B x T | n_h=1 off | n_h=1 on |" in out
    assert "| 1 x 2048 | 2.50x | 3.50x |" in out
    assert "| 8 x 8192 | 1.70x | 1.25x |" in out
    assert "Worst point: B = 8, T = 8192, n_h = 1, gate on, 1.25x (ours o+fin 0.400 ms, fla 0.500 ms)" in out
    assert "Machine: Test GPU, CUDA 13.0, torch 2.11+cu130, Triton 3.6.0, fla 0.6.0, commit abc1234, " \
           "2026-11-28." in out
    assert "`python -m benchmarks.kernels --json OUT`" in out  # the default command when the file names none
    assert "## Delta-rule forward: real-model shapes" not in out  # sections the run skipped get no table


def test_real_and_accuracy_tables_show_missing_values_as_dashes(tmp_path, capsys):
    real = [dict(shape="GDN", Hk=6, Hv=6, K=256, V=512, n_h=1, B="varlen", T=32768, varlen=True, lengths=[10, 20, 30],
                 ours_o_final_ms=1.125, fla_ms=1.65, speedup_o_final_vs_fla=1.4667, speedup_vs_fla=float("nan"),
                 x_mem_floor=2.94)]
    acc = [dict(kernel="ours", dtype="bfloat16", n_h=1, gate=False, o=1e-3, final=2e-3, boundary=None),
           dict(kernel="ours", dtype="bfloat16", n_h=2, gate=True, o=7.2e-3, final=1e-3, boundary=None)]
    rc, out, _ = _report(tmp_path, capsys, _run(command="python -m benchmarks.kernels --skip forward", real=real,
                                                accuracy=acc))
    assert rc == 0
    assert "| GDN | 6/6 | 256/512 | packed (3 docs) | 1.125 | 1.650 | 1.47x | – | 2.9 |" in out
    assert "| ours | bfloat16 | 7.2e-03 | 2.0e-03 | – |" in out  # the largest over the variants, per column
    assert "`python -m benchmarks.kernels --skip forward`" in out
    assert "CUDA ?" in out and "commit ?" in out  # facts the file lacks are marked, not invented


def test_files_render_in_the_order_given(tmp_path, capsys):
    rc, out, _ = _report(tmp_path, capsys, _run(forward=_forward_rows(), device="GPU A"),
                         _run(forward=_forward_rows(), device="GPU B"))
    assert rc == 0 and out.index("GPU A") < out.index("GPU B")


def test_a_file_that_is_not_a_benchmark_run_is_one_line_and_exit_2(tmp_path, capsys):
    rc, out, err = _report(tmp_path, capsys, _run(forward=_forward_rows()), {"rows": []})
    assert rc == 2 and out == ""  # nothing printed, not even the good file's tables
    assert err.count("\n") == 1 and "run1.json" in err and "benchmarks.kernels --json" in err
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    assert main([str(bad)]) == 2
    assert "broken.json: not JSON" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err


def test_a_table_file_is_rendered_as_given_with_its_machine_line(tmp_path, capsys):
    table = dict(kind="table", title="Per-channel gates", command="python -m benchmarks.kda", device="Test GPU",
                 description="ms by do_bench medians.", columns=["B", "T", "ours", "fla"],
                 rows=[[1, 2048, 0.312, 0.675], [8, 8192, 7.705, 9.062]], note="fla's B = 1 times move.")
    rc, out, _ = _report(tmp_path, capsys, table, _run(forward=_forward_rows()))
    assert rc == 0
    assert "## Per-channel gates" in out and "`python -m benchmarks.kda` (run0.json). ms by do_bench medians." in out
    assert "| B | T | ours | fla |" in out and "| 8 | 8192 | 7.705 | 9.062 |" in out
    assert "Machine: Test GPU, CUDA ?, torch ?" in out and "Note: fla's B = 1 times move." in out
    assert out.index("Per-channel gates") < out.index("the grid")  # files keep their order


def test_a_table_row_of_the_wrong_length_is_refused_in_one_line(tmp_path, capsys):
    table = dict(kind="table", title="t", columns=["a", "b"], rows=[[1, 2], [3]])
    rc, out, err = _report(tmp_path, capsys, table)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "row 1 has 1 cells, the table 2 columns" in err


def test_a_whole_results_folder_is_named_by_its_glob(tmp_path, capsys):
    _report(tmp_path, capsys, _run(forward=_forward_rows()), _run(forward=_forward_rows()))
    main([str(p) for p in sorted(tmp_path.glob("*.json"))])
    assert f"`python -m benchmarks.report {tmp_path.as_posix()}/*.json > docs/benchmarks.md`" in capsys.readouterr().out
