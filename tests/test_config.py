"""specdec.config.load_config: unknown and retired keys fail naming the key and what to do."""

from __future__ import annotations

import pytest

import specdec.config as config_module
from specdec.config import ConfigError, load_config


def test_an_unknown_key_names_itself_and_the_keys_of_its_section(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("front:\n  cost_aware:\n    in_stepp: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith("invalid config: front.cost_aware.in_stepp: unknown key (known here: enabled,")
    assert "in_step_wait_ms" in message and "Extra inputs" not in message


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



@pytest.mark.parametrize("yaml_text, key", [
    ("front:\n  dynamic_gamma:\n    enabled: false\n", "front.dynamic_gamma"),
    ("front:\n  fallback:\n    window: 8\n", "front.fallback.window"),
    ("front:\n  fallback:\n    min_acceptance: 0.0\n", "front.fallback.min_acceptance"),
    ("front:\n  fallback:\n    probe_every: 16\n    reconnect_s: 1.0\n", "front.fallback.probe_every"),
])
def test_the_removed_control_keys_fail_naming_themselves(tmp_path, yaml_text, key):
    """Dynamic gamma and the low-acceptance fallback were removed (docs/heuristics.md): a config still
    setting one of their keys fails naming that key and pointing at the reason, not a generic message."""
    path = tmp_path / "serve.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"invalid config: {key}: no longer a config key: ")
    assert "docs/heuristics.md" in message and "Extra inputs" not in message
