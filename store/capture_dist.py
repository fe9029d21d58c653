"""Data-parallel capture: `torchrun --nproc-per-node N -m store.capture_dist CKPT --data SPEC --out STORE`.

Same flags as `deltalab capture` (which also detects torchrun by itself:
`torchrun --nproc-per-node N --no-python deltalab capture ...`). Each rank captures the batches
i with i % N == rank and writes only their chunks; rank 0 creates the store first.
"""

from __future__ import annotations

import json
import sys

from deltalab.store.capture import capture
from deltalab.store.cliparse import OneLineParser
from deltalab.store.errors import StoreError


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m deltalab.store.capture_dist", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hooks", "--vars", dest="hooks")
    p.add_argument("--layers")
    p.add_argument("--heads")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        from deltalab.models import CheckpointError
    except ImportError:  # pragma: no cover - models is part of the distribution
        CheckpointError = ValueError  # noqa: N806
    try:
        summary = capture(args.checkpoint, args.data, args.out, hooks=args.hooks, layers=args.layers, heads=args.heads,
                          batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                          progress=not args.no_progress, command_line=["python", "-m", "deltalab.store.capture_dist",
                                                                       *(argv or sys.argv[1:])])
    except (StoreError, CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
