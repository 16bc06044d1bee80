"""Every setting either works or is refused at start-up with a message naming it and what it accepts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from api.settings import CHOICES, Settings, SettingsError
from services.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("field", sorted(CHOICES))
def test_a_value_outside_the_choices_is_refused_naming_the_variable_and_the_choices(field):
    env, allowed = CHOICES[field]
    with pytest.raises(SettingsError) as err:
        Settings(**{field: "nonsense"})
    message = str(err.value)
    assert env in message and "nonsense" in message and ", ".join(allowed) in message
    assert isinstance(err.value, InvalidInput) and isinstance(err.value, ValueError)
    for value in allowed:  # every accepted value builds, in any case
        assert getattr(Settings(**{field: value.upper()}), field) == value


def test_the_local_reranker_is_refused_while_no_adapter_ships():
    assert not (ROOT / "services" / "adapters" / "local_reranker.py").exists()
    with pytest.raises(SettingsError, match="MEMEX_RERANKER=local .*none, workers-ai"):
        Settings(reranker="local")


@pytest.mark.parametrize("env, value, text", [
    ("MEMEX_RERANKER", "local", "MEMEX_RERANKER must be one of none, workers-ai"),
    ("MEMEX_EMBEDDER", "openai", "MEMEX_EMBEDDER must be one of local, workers-ai, hash"),
    ("MEMEX_DECISIONS", "maybe", "MEMEX_DECISIONS must be one of on, off, full"),
    ("MEMEX_KEY_RATE_PER_MINUTE", "fast", "MEMEX_KEY_RATE_PER_MINUTE must be an integer"),
    ("MEMEX_RANK_TASK_HALF_LIFE_DAYS", "a week", "MEMEX_RANK_TASK_HALF_LIFE_DAYS must be a number"),
    ("MEMEX_RANK_RECALL_TOP", "0", "MEMEX_RANK_RECALL_TOP is no longer a setting: searches no longer count"),
    ("MEMEX_KEYWORD_INDEX_FROM", "-1", "MEMEX_KEYWORD_INDEX_FROM must be 0 \\(off\\) or a number of thoughts"),
    ("MEMEX_KEYWORD_INDEX_FROM", "many", "MEMEX_KEYWORD_INDEX_FROM must be an integer"),
])
def test_from_env_refuses(monkeypatch, env, value, text):
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError, match=text):
        Settings.from_env()


def test_decisions_values(monkeypatch):
    for value, (on, full) in {"on": (True, False), "OFF": (False, False), "full": (True, True), "0": (False, False)}.items():
        monkeypatch.setenv("MEMEX_DECISIONS", value)
        s = Settings.from_env()
        assert (s.decisions, s.decisions_full) == (on, full), value


def test_memex_serve_refuses_an_unsupported_setting_with_a_message_not_a_traceback(tmp_path):
    env = {**os.environ, "MEMEX_RERANKER": "local", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", "9", "--data-dir", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "error: MEMEX_RERANKER=local" in proc.stderr and "none, workers-ai" in proc.stderr
    assert "listening" not in proc.stdout
