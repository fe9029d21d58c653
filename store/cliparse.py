"""argparse that reports a bad command line in one line (the project's error convention), exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """`error: PROG: MESSAGE (see 'PROG --help')` on stderr instead of argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)
