"""The README's option tables are the configuration dataclasses' (one source of truth): every
EngineConfig field is in the engine options table with its flag, and the defaults the table
states are the fields' defaults; every ServerConfig field's flag is in the server section."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from sangam.config import EngineConfig
from sangam.serve.config import ServerConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(title)
    end = README.find("\n#", start + len(title))
    return README[start:end if end >= 0 else None]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_the_engine_options_table_is_engine_config():
    rows = [line.split("|")[1:4] for line in _section("### Engine options").splitlines()
            if line.startswith("| `")]
    listed = {}
    for options, flags, meaning in rows:
        for name in re.findall(r"`(\w+)`", options):
            listed[name] = (flags, meaning, len(re.findall(r"`(\w+)`", options)))
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert set(listed) == set(fields), (set(fields) - set(listed), set(listed) - set(fields))
    for name, (flags, meaning, shared) in listed.items():
        assert f"`{_flag(name)}`" in flags or (shared > 1 and "..." in flags), name
        default = re.search(r"\(default ([\w.]+)\)", meaning)
        if default and shared == 1:
            value = fields[name].default
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            assert default.group(1) == shown, (name, default.group(1), value)


def test_every_server_flag_is_in_the_server_section():
    section = _section("## The server")
    missing = [_flag(f.name) for f in dataclasses.fields(ServerConfig)
               if f"`{_flag(f.name)}" not in section]
    assert not missing, missing
