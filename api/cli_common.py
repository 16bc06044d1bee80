"""What every ``memex`` subcommand shares: settings from the arguments and the environment, a ``Memex`` without
its worker for the length of a command, the ``--data-dir`` and ``--json`` options, output (human text by default,
one JSON document with ``--json``), durations (``--expires-in 30d``) and progress bars (tqdm, on stderr).

``api.cli`` builds the parser and hooks in the areas' commands (``api.*_cli``); those import this module, never
``api.cli`` (which imports them).

Output: a command that prints data prints it for people by default (real characters, times as dates, tables for
lists) and as one JSON document on stdout with ``--json`` (``ensure_ascii=False``: real characters there too).
Progress bars (tqdm, the same way in every long command) go to stderr, only when stderr is a terminal and never with
``--json``; ``MEMEX_PROGRESS=always`` (or ``never``) overrides both (logs of a long import, tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from api.settings import Settings, SettingsError

__all__ = ["settings_from", "make_memex", "with_memex", "emit", "dumps", "render", "table", "add_data_dir", "add_json",
           "progress", "progress_shown", "json_quiet", "parse_duration", "format_time"]


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


def add_data_dir(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--data-dir", default=None,
                    help="directory for the SQLite file and vector index (default ./data or MEMEX_DATA_DIR)")


def add_json(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true",
                    help="print one JSON document on stdout (for scripts); no progress bars")


# -- output ----------------------------------------------------------------------------------------------------


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, default=str)


def emit(obj: Any, args: argparse.Namespace | None = None, *, human: Any = None, stream: TextIO | None = None) -> None:
    """Print ``obj``: JSON with ``--json``, else ``human(obj)`` (a string) or the generic rendering."""
    out = stream or sys.stdout
    if args is not None and getattr(args, "json", False):
        print(dumps(obj), file=out)
    else:
        print(human(obj) if human is not None else render(obj), file=out)


def format_time(ms: Any) -> str:
    """Epoch milliseconds as a UTC date and time (``-`` for none)."""
    if ms is None:
        return "-"
    try:
        return datetime.fromtimestamp(int(ms) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return str(ms)


def _is_time(key: str, value: Any) -> bool:
    return (key.endswith("_at") or key in ("since", "until")) and isinstance(value, int) and not isinstance(value, bool) \
        and value > 10**11


def _scalar(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if _is_time(key, value):
        return format_time(value)
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(str(v) for v in value) if value else "-"
    return str(value)


def render(obj: Any, indent: int = 0) -> str:
    """A nested structure as indented ``key: value`` lines, lists of records as numbered blocks: for people."""
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return pad + "(none)"
        lines = []
        for key, value in obj.items():
            label = str(key).replace("_", " ")
            if isinstance(value, dict) and value:
                lines.append(f"{pad}{label}:")
                lines.append(render(value, indent + 2))
            elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
                lines.append(f"{pad}{label}: {len(value)}")
                lines.append(render(value, indent + 2))
            else:
                lines.append(f"{pad}{label}: {_scalar(str(key), value if value != {} else None)}")
        return "\n".join(lines)
    if isinstance(obj, list):
        if not obj:
            return pad + "(none)"
        blocks = []
        for i, item in enumerate(obj, 1):
            if isinstance(item, (dict, list)):
                blocks.append(f"{pad}- {i}:\n{render(item, indent + 4)}")
            else:
                blocks.append(f"{pad}- {item}")
        return "\n".join(blocks)
    return pad + _scalar("", obj)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]], *, empty: str = "(none)") -> str:
    """Rows as an aligned text table: ``columns`` is (header, key) pairs; times and lists shown as in ``render``."""
    if not rows:
        return empty
    cells = [[h for h, _ in columns]] + [[_scalar(k, r.get(k)) for _, k in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


# -- durations -----------------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int:
    """``90m``, ``12h``, ``30d``, ``2w`` (s, m, h, d, w) as seconds, for argparse (a clear error for anything else)."""
    found = _DURATION.match(text or "")
    if not found or int(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a positive whole number and a unit, s m h d or w (e.g. 90m, 12h, 30d, 2w)")
    return int(found.group(1)) * _UNIT_SECONDS[found.group(2)]


# -- progress bars ---------------------------------------------------------------------------------------------------


def progress_shown(stream: TextIO | None = None, show: bool | None = None) -> bool:
    """Whether a bar is drawn: ``MEMEX_PROGRESS`` when it says always or never (the operator's word wins, even over
    ``--json``: bars go to stderr, never into the JSON), else ``show`` when given, else whether the stream (stderr by
    default) is a terminal."""
    mode = os.environ.get("MEMEX_PROGRESS", "auto").strip().lower()
    if mode in ("always", "1", "on", "yes"):
        return True
    if mode in ("never", "0", "off", "no"):
        return False
    if show is not None:
        return show
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def progress(total: int | None, desc: str, unit: str = "it", *, stream: TextIO | None = None, show: bool | None = None,
             initial: int = 0, scale: bool = False):
    """A tqdm bar on stderr (or ``stream``) for every long command, drawn as ``progress_shown`` says (``show=False``
    for ``--json``). ``scale``: counts shown with SI prefixes (bytes)."""
    from tqdm import tqdm

    return tqdm(total=max(0, total) if total is not None else None, desc=desc, unit=unit, initial=initial,
                file=stream or sys.stderr, disable=not progress_shown(stream, show), unit_scale=scale,
                unit_divisor=1024 if scale else 1000, dynamic_ncols=True, leave=True, mininterval=0.2)


def json_quiet(args: argparse.Namespace) -> bool | None:
    """``show`` for ``progress`` under these arguments: never with ``--json``, else automatic."""
    return False if getattr(args, "json", False) else None
