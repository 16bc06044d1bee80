"""What every ``memex`` subcommand shares: settings from the arguments and the environment, a ``Memex`` without
its worker for the length of a command, JSON output, the ``--data-dir`` option and a text progress bar.

``api.cli`` builds the parser and hooks in the areas' commands (``api.*_cli``); those import this module, never
``api.cli`` (which imports them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from api.settings import Settings, SettingsError

__all__ = ["settings_from", "make_memex", "with_memex", "print_json", "add_data_dir", "ProgressBar"]


def settings_from(args: argparse.Namespace, **extra) -> Settings:
    """The settings of the environment, with ``--data-dir`` (when given) and ``extra`` over them."""
    overrides = dict(extra)
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = Path(args.data_dir)
    try:
        return Settings.from_env(**overrides)
    except SettingsError:
        raise
    except ValueError as exc:  # a setting refused while reading the environment: a message, not a traceback
        raise SettingsError(str(exc)) from exc


def make_memex(settings: Settings):
    """A ``Memex`` for a command: no job worker (the serving process's worker picks up what a command queues)."""
    from api.wiring import Memex

    return Memex(settings.with_(run_worker=False))


async def with_memex(settings: Settings, fn):
    """Start a ``Memex`` (migrations applied, no worker), run ``await fn(memex)``, stop it."""
    memex = make_memex(settings)
    try:
        await memex.start(worker=False)
        return await fn(memex)
    finally:
        await memex.stop()


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def add_data_dir(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--data-dir", default=None,
                    help="directory for the SQLite file and vector index (default ./data or MEMEX_DATA_DIR)")


class ProgressBar:
    """A one-line text progress bar on a stream (a TTY redraws in place; anything else gets a line per step)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = max(0, total), label, width
        self.stream = stream or sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, step: int) -> None:
        self.done += step
        self._draw(end="" if self.tty else "\n")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, end: str) -> None:
        frac = 1.0 if self.total == 0 else min(1.0, self.done / self.total)
        filled = int(frac * self.width)
        rate = self.done / max(1e-9, time.monotonic() - self.started)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"({frac:4.0%}) {rate:,.0f} msg/s")
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()
