"""One declaration per setting: every setting is reachable by flag, SPECMESH_* variable and
config file under its flat name, wherever it sits in the settings tree, with precedence
flags > environment > config file > defaults; bad values name the setting, where it came
from and what its owner allows; the composition root passes each service its group."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
import yaml

from services.cli import _flag_values, _parser
from services.common import env
from services.common.env import setting_fields
from services.settings import Settings, read_settings, setting_names, setting_value

NAMES = [n for n in setting_names() if n != "config"]  # `config` names the file itself


def two_values(name: str) -> tuple[object, object]:
    """Two distinct valid values for a setting; the first differs from the default."""
    field = setting_fields(Settings)[name][1]
    default = field.default
    if get_origin(field.annotation) is Literal:
        options = [o for o in get_args(field.annotation) if o != default]
        return options[0], (options[1] if len(options) > 1 else default)
    if field.annotation is bool:
        return (not default), default
    if field.annotation is int:
        return default + 7, default + 3
    if field.annotation is float:
        return default + 1.5, default + 0.5
    return f"{name}-a", f"{name}-b"


def env_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def flag_args(name: str, value) -> list[str]:
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if value else f"--no-{name.replace('_', '-')}"]
    return [flag, str(value)]


def from_cli(argv: list[str], environ: dict) -> Settings:
    args = _parser().parse_args(argv)
    return read_settings(environ, **_flag_values(args))


def write_config(tmp_path, values: dict) -> str:
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"settings": values, "pools": {"default": {}}}))
    return str(path)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("command", [["serve", "router"], ["up"]])
def test_flag_beats_environment(name, command):
    a, b = two_values(name)
    settings = from_cli(command + flag_args(name, a), {f"SPECMESH_{name.upper()}": env_text(b)})
    assert setting_value(settings, name) == a


@pytest.mark.parametrize("name", NAMES)
def test_environment_beats_config_file(name, tmp_path):
    a, b = two_values(name)
    path = write_config(tmp_path, {name: b})
    settings = read_settings({"SPECMESH_CONFIG": path, f"SPECMESH_{name.upper()}": env_text(a)})
    assert setting_value(settings, name) == a


@pytest.mark.parametrize("name", NAMES)
def test_config_file_beats_default(name, tmp_path):
    a, _ = two_values(name)
    settings = from_cli(["serve", "router", "--config", write_config(tmp_path, {name: a})], {})
    assert setting_value(settings, name) == a
    assert setting_value(read_settings({}), name) == setting_fields(Settings)[name][1].default


def test_every_setting_has_help_and_a_flag_on_up_and_serve():
    for name, (_, field) in setting_fields(Settings).items():
        assert field.description, name
    for command in (["serve", "router"], ["up"]):
        args = _parser().parse_args(command)
        assert set(setting_names()) <= set(vars(args)), command


def test_invalid_values_name_the_setting_and_the_allowed_values(tmp_path):
    with pytest.raises(ValueError) as exc:
        read_settings({"SPECMESH_SPECULATION_METHOD": "medusa"})
    assert str(exc.value) == ("invalid setting speculation_method='medusa' (from "
                              "SPECMESH_SPECULATION_METHOD): Input should be 'off', 'prompt_lookup', "
                              "'suffix', 'draft_model', 'dynamic_tree' or 'grammar'")
    with pytest.raises(ValueError) as exc:
        read_settings({"SPECMESH_CONFIG": write_config(tmp_path, {"num_blocks": 0})})
    assert str(exc.value) == (f"invalid setting num_blocks=0 (from config file {tmp_path}/mesh.yaml): "
                              "Input should be greater than 0")
    with pytest.raises(ValueError) as exc:
        read_settings({"SPECMESH_CONFIG": write_config(tmp_path, {"num_blocs": 8})})
    assert "unknown setting 'num_blocs'" in str(exc.value)
    with pytest.raises(FileNotFoundError):
        read_settings({"SPECMESH_CONFIG": str(tmp_path / "missing.yaml")})


def test_a_speculation_depth_beyond_the_draft_limit_names_the_flag_and_the_limit():
    with pytest.raises(ValueError) as exc:
        from_cli(["up", "--speculation-depth", "20"], {})
    assert str(exc.value) == ("invalid setting speculation_depth=20 (from --speculation-depth): "
                              "Input should be less than or equal to 16")


def test_max_queued_tokens_reaches_the_engine():
    from services.builders import engine_config
    settings = from_cli(["serve", "target", "--max-queued-tokens", "1000"], {})
    assert engine_config(settings, Path("unused")).max_queued_tokens == 1000

