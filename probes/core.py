"""The two types every probe module shares, kept apart from `probes.base` so that the store readers
(`probes.data`) and the result sink (`probes.results`), which `probes.base` uses, need not import it back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import xarray as xr

from deltalab.models.run_files import clean_json


class ProbeError(ValueError):
    """Bad input to a probe (missing variable, wrong flag, missing checkpoint): one line, names the fix."""


@dataclass
class ProbeResult:
    """A probe's xarray.Dataset of results plus its JSON records (one per layer/head[/step])."""

    name: str
    dataset: xr.Dataset
    records: list[dict[str, Any]] = field(default_factory=list)
    summary_keys: list[str] | None = None  # columns of the human-readable table

    def to_json(self) -> str:
        """The records as a JSON list (NaN written as null)."""
        return json.dumps(clean_json(self.records), indent=1)
