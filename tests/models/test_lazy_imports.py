"""`models` and `kernels` load their public names on first use, so the store, probes and dashboard import no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_constants_and_readers_import_without_torch():
    out = _run("import sys\n"
               "from models import IGNORE_INDEX\n"
               "from kernels.constants import CHUNK_SIZE\n"
               "import models.run_files, store.schema, probes.data, app.default_store, app.frame, app.views.keys\n"
               "print(IGNORE_INDEX, CHUNK_SIZE, 'torch' in sys.modules)")
    assert out == "-100 64 False"


def test_public_names_resolve_on_first_use():
    from deltalab import kernels, models
    from deltalab.kernels.delta_rule.naive import CHUNK_SIZE
    from deltalab.models.lm import IGNORE_INDEX

    assert models.IGNORE_INDEX is IGNORE_INDEX and CHUNK_SIZE == 64
    assert models.DeltaProductForCausalLM.__module__ == "deltalab.models.lm"
    assert kernels.naive_delta_product.__module__ == "deltalab.kernels.delta_rule.naive"
    assert set(models.__all__) <= set(dir(models)) and set(kernels.__all__) <= set(dir(kernels))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = models.nope
