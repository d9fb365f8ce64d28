"""specdec.config.load_config: unknown and retired keys fail naming the key and what to do."""

from __future__ import annotations

import pytest

import specdec.config as config_module
from specdec.config import ConfigError, load_config


def test_an_unknown_key_names_itself_and_the_keys_of_its_section(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("front:\n  cost_aware:\n    max_gama: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith("invalid config: front.cost_aware.max_gama: unknown key (known here: enabled,")
    assert "max_gamma" in message and "Extra inputs" not in message


def test_an_unknown_top_level_key_lists_the_sections():
    with pytest.raises(ConfigError, match=r"nope: unknown key \(known here: models, grpc, draft, target, front\)"):
        load_config(None, {"nope.x": 1})


def test_a_retired_key_says_what_replaced_it(tmp_path, monkeypatch):
    monkeypatch.setitem(config_module.RETIRED_KEYS, "front.cost_aware.old_knob", "renamed to front.cost_aware.new_knob")
    path = tmp_path / "serve.yaml"
    path.write_text("front:\n  port: 0\n  cost_aware:\n    old_knob: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == ("invalid config: front.cost_aware.old_knob: no longer a config key: "
                              "renamed to front.cost_aware.new_knob")


@pytest.mark.parametrize("key", sorted(config_module.RETIRED_KEYS))
def test_each_removed_heuristics_key_fails_naming_itself_and_the_record(key):
    """Every retired key (docs/heuristics.md) fails naming the key and the page that says why."""
    with pytest.raises(ConfigError) as err:
        load_config(None, {key: 1})
    message = str(err.value)
    assert message.startswith(f"invalid config: {key}: no longer a config key: "), message
    assert "docs/heuristics.md" in message
