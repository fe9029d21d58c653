"""deltalab: the interpretability workbench for delta-rule linear RNNs.

The repository's top-level folders install as the subpackages of this one name (pyproject's package-dir):
`deltalab.kernels` (math on tensors), `deltalab.models` (hooked modules and checkpoints), `deltalab.tasks`,
`deltalab.store` (capture and the zarr store), `deltalab.probes` and `deltalab.train` (analyses and training over
stores) and `deltalab.app` (the CLI and the dashboard).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("deltalab")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"
