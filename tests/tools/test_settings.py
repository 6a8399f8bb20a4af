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
# Text settings with a grammar of their own: two valid values.
TEXT_VALUES = {"speculation_methods": ("chat-*=suffix", "code-*=prompt_lookup|suffix,*=off")}


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
    return TEXT_VALUES.get(name, (f"{name}-a", f"{name}-b"))


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
                              "'suffix', 'draft_model', 'dynamic_tree', 'grammar', 'eagle' or 'auto'")
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



def test_an_old_flat_name_still_sets_the_nested_value(tmp_path):
    settings = read_settings({"SPECMESH_NUM_BLOCKS": "64", "SPECMESH_CACHE_BACKEND": "redis",
                              "SPECMESH_REPLICA_POLL_SECONDS": "2.5"})
    assert (settings.target.num_blocks, settings.cache.backend, settings.router.poll_interval_s) == (64, "redis", 2.5)
    settings = from_cli(["serve", "cache", "--config", write_config(tmp_path, {"cache_max_memory_mb": 8}),
                         "--max-prompt-bytes", "4000"], {})
    assert (settings.cache.max_memory_mb, settings.limits.max_prompt_bytes) == (8, 4000)


def test_a_bad_kernels_value_lists_the_backends_the_kernel_selection_knows():
    from services.target.kernels.select import BACKENDS, get_kernels
    from services.target.settings import KERNEL_BACKENDS
    with pytest.raises(ValueError) as exc:
        read_settings({"SPECMESH_KERNELS": "cuda"})
    allowed = ", ".join(repr(b) for b in KERNEL_BACKENDS[:-1]) + f" or {KERNEL_BACKENDS[-1]!r}"
    assert str(exc.value) == f"invalid setting kernels='cuda' (from SPECMESH_KERNELS): Input should be {allowed}"
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        get_kernels("cuda")
    assert BACKENDS is KERNEL_BACKENDS  # the selection refuses what the settings refuse: one tuple


def test_a_flag_outside_the_declared_list_is_refused_listing_the_owners_values(capsys):
    from services.target.model.linear import WEIGHT_FORMATS
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "target", "--weights", "int4"])
    choices = ", ".join(repr(f) for f in WEIGHT_FORMATS)
    assert f"argument --weights: invalid choice: 'int4' (choose from {choices})" in capsys.readouterr().err


def test_a_service_config_built_without_settings_is_checked_against_the_same_declaration(tmp_path):
    from services.cache.config import CacheConfig
    from services.router.config import RouterConfig
    from services.target.config import EngineConfig
    with pytest.raises(ValueError) as exc:
        EngineConfig(model_dir=tmp_path, kernels="cuda")
    assert str(exc.value) == ("EngineConfig.kernels='cuda': Input should be 'auto', 'triton', 'cpu' or "
                              "'reference'")
    with pytest.raises(ValueError, match=r"RouterConfig.speculation_depth=20: Input should be less than or equal to 16"):
        RouterConfig(target_address="t:1", tokens={"t": "a"}, speculation_depth=20)
    with pytest.raises(ValueError, match=r"RouterConfig.replica_policy='random': Input should be 'kv_aware'"):
        RouterConfig(target_address="t:1", tokens={"t": "a"}, replica_policy="random")
    with pytest.raises(ValueError, match=r"CacheConfig.backend='disk': Input should be 'memory' or 'redis'"):
        CacheConfig(backend="disk")


def test_each_service_gets_its_group_as_set(tmp_path):
    """Every field of the target's, router's and cache's groups reaches their service's config."""
    from services.builders import cache_config, engine_config, router_config
    from services.settings import setting_names

    def group_names(group: str) -> list[str]:
        return [n for n in setting_names() if setting_fields(Settings)[n][0][0] == group]

    flags = ["--dev"]
    for name in group_names("target") + group_names("router") + group_names("cache"):
        value = {"speculation_method": "suffix", "tokens": "tok=tenant", "cache_backend": "memory",
                 "redis_url": "", "cache_replicas": "", "chat_template": "none", "device": "cpu",
                 "speculation_depth": 7, "speculation_nodes": 9,
                 # generic cannot run with the tensor_parallel set here
                 "forward": "auto"}.get(name, two_values(name)[0])
        flags += flag_args(name, value)
    settings = from_cli(["up", *flags], {})
    engine = engine_config(settings, tmp_path)
    for name, value in settings.target.engine_fields().items():
        assert getattr(engine, name) == value, name
    assert engine.draft_timeout_s == settings.target.draft_timeout_ms / 1000
    assert engine.limits is settings.limits
    router = router_config(settings)
    for name, value in settings.router.config_fields().items():
        assert getattr(router, name) == value, name
    assert router.tokens == {"tok": "tenant"}
    cache = cache_config(settings)
    for name, value in settings.cache.config_fields().items():
        assert getattr(cache, name) == value, name
    assert cache.max_memory_bytes == settings.cache.max_memory_mb << 20


def test_the_target_does_not_call_the_draft_service_when_the_router_plans_no_speculation(tmp_path):
    from services.builders import engine_config
    assert engine_config(from_cli(["up"], {}), tmp_path).draft_address == "127.0.0.1:50053"
    assert engine_config(from_cli(["up", "--speculation", "off"], {}), tmp_path).draft_address == ""


def test_a_mesh_wide_reader_passes_over_the_services_keys_of_the_config_file(tmp_path):
    path = write_config(tmp_path, {"num_blocks": 8, "tls_dir": "/certs"})
    assert env.read_settings({"SPECMESH_CONFIG": path}, others_ok=True).tls_dir == "/certs"
    with pytest.raises(ValueError, match="unknown setting 'num_blocks'"):
        env.read_settings({"SPECMESH_CONFIG": path})


def test_a_flat_name_declared_in_two_groups_is_refused():
    from pydantic import Field

    from services.common.settings_group import SettingsGroup

    class One(SettingsGroup):
        size: int = Field(1, description="one")

    class Two(SettingsGroup):
        bytes_: int = Field(2, alias="size", description="two")

    class Tree(SettingsGroup):
        one: One = Field(default_factory=One)
        two: Two = Field(default_factory=Two)

    with pytest.raises(TypeError, match="setting 'size' is declared twice"):
        env.setting_fields(Tree)
