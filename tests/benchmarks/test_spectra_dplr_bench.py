"""`python -m benchmarks.spectra_dplr` prints its table (ours vs dense eigvals, measured in the same run)."""

from __future__ import annotations

from benchmarks.spectra_dplr import main, row


def test_row_is_exact_and_table_prints(capsys):
    import torch

    r = row(16, 64, 8, torch.device("cpu"), None)
    assert r["err_exact"] < 1e-13 and r["err_dense"] < 1e-12 and r["ours_per_s"] > 0 and r["dense_per_s"] > 0
    main(["--dk", "8", "--batch", "32", "--dense-batch", "4", "--device", "cpu"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("diagonal-plus-rank-one spectra on CPU") and out[2].split()[:2] == ["8", "32"]
