"""`--device` values checked before anything uses them: one line naming the value and the choices."""

from __future__ import annotations

import re

DEVICE = re.compile(r"auto|cpu|cuda(:\d{1,3})?|mps")
"""Devices deltalab runs on: cpu, cuda or cuda:N (one GPU), mps (Apple), auto (cuda when visible, else cpu)."""


def check_device(name: object, flag: str = "--device", allow_auto: bool = True) -> str:
    """`name` when it is a device deltalab runs on; ValueError in one line otherwise (e.g. `--device tpu`)."""
    text = str(name).strip() if isinstance(name, str) else ""
    if not DEVICE.fullmatch(text) or (text == "auto" and not allow_auto):
        choices = ("auto, " if allow_auto else "") + "cpu, cuda, cuda:N or mps"
        raise ValueError(f"{flag} {str(name)[:40]!r} is not a device deltalab runs on: use {choices}")
    return text
