"""Reading settings, and the settings every service shares.

The settings are one tree (services/settings.py `Settings`): the mesh-wide settings below
(`MeshSettings`: addresses, TLS, telemetry, the model, request limits), with one group per
service nested in it (`settings.target`, `settings.router`, `settings.draft`,
`settings.cache`), each declared in its own service beside the code that owns its values
(services/target/settings.py and so on). The composition root (services/builders.py) hands
each service its group.

Every setting still has one flat name, unique across the tree: a field's own name, or its
`alias` where the service's config calls the value differently (`cache_backend` is
`settings.cache.backend`). That flat name is what users write: the CLI flag
(`--num-blocks`, generated in services/cli.py), the environment variable
(`SPECMESH_NUM_BLOCKS`) and the key under `settings:` in the mesh config file (YAML, given
by `--config` or `SPECMESH_CONFIG`; other top-level keys of that file, such as `pools:`,
belong to their own readers). So nesting changed no spelling.

Precedence: flags > SPECMESH_* environment > config file > defaults. A value that does not
fit its declaration raises ValueError naming the setting, where it came from (the flag, the
variable or the config file) and what is allowed. To add a setting, add one field to the
group of the service that reads it (`name: type = Field(default, description=...)`).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationError
from pydantic.fields import FieldInfo

from services.common.limits import RequestLimits
from services.common.settings_group import SettingsGroup

DEFAULT_PORTS = {"router": 50051, "target": 50052, "draft": 50053, "cache": 50054, "gateway": 8000}
DEV_TOKEN = "specmesh-dev-token"  # what `specmesh up` accepts unless SPECMESH_TOKENS is set
DEV_SALT_SECRET = "specmesh-dev-secret"  # public: `serve router` refuses it unless --dev
ENV_PREFIX = "SPECMESH_"
# Read when SPECMESH_<NAME> is unset.
_ENV_ALIASES = {"otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT", "service_name": "OTEL_SERVICE_NAME"}

# Weight and activation dtypes of a model (the target's and the draft LM's), as torch spells them.
ModelDtype = Literal["bfloat16", "float32", "float16"]
MODEL_DTYPES: tuple[str, ...] = get_args(ModelDtype)


class MeshSettings(SettingsGroup):
    """The settings of the whole mesh, read by more than one service or by the tools."""

    config: str = Field("", description="mesh config file (YAML); its `settings:` mapping sets any "
                        "setting below (flags and SPECMESH_* variables win)")
    host: str = Field("127.0.0.1", description="interface the services listen on")
    port: int = Field(0, ge=0, le=65535, description="listening port; 0 = the service's default "
                      "(for `up`: the router's port, target/draft/cache take the next three)")
    gateway_port: int = Field(DEFAULT_PORTS["gateway"], ge=0, le=65535,
                              description="OpenAI-compatible HTTP gateway port (`serve gateway`; "
                              "for `up`: 0 = no gateway)")
    model: str = Field("default", description="target model: 'default' (Gemma 3 270M) or a local "
                       "Hugging Face model directory")
    model_cache: str = Field(str(Path.home() / ".cache" / "specmesh" / "models"),
                             description="where prepared models are cached")
    dtype: ModelDtype = Field("bfloat16", description="weight and activation dtype of the target (and draft LM)")
    max_tokens_limit: int = Field(4096, gt=0, description="largest max_tokens a request may ask for")
    max_samples: int = Field(16, gt=0, le=128, description="largest n (samples of one prompt, sharing "
                             "one prefill) a request may ask for; the target also caps it at max_num_seqs")
    limits: RequestLimits = Field(default_factory=RequestLimits)  # prompt and stop sizes (router and target)
    router_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['router']}",
                                description="router address (host:port) the clients and gateway call")
    target_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['target']}",
                                description="target address the router calls")
    draft_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['draft']}",
                               description="draft service address the target calls")
    cache_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['cache']}",
                               description="cache service address: HOST:PORT, a comma-separated list, or "
                               "dns:///NAME:PORT (every instance a headless Service resolves to); the router "
                               "shards its cache calls across them by key")
    token: str = Field(DEV_TOKEN, description="bearer token the `generate`/`status` clients send")
    otlp_endpoint: str = Field("", description="OpenTelemetry OTLP gRPC endpoint; '' = no export "
                               "(also read from OTEL_EXPORTER_OTLP_ENDPOINT)")
    service_name: str = Field("", description="OpenTelemetry service.name; '' = specmesh-SERVICE "
                              "(also read from OTEL_SERVICE_NAME; `up` appends -SERVICE)")
    metrics_port: int = Field(9464, ge=0, le=65535, description="`serve`: port of the Prometheus "
                              "/metrics endpoint; 0 = none")
    metrics_base_port: int = Field(9464, ge=0, le=65535, description="`up`: router, target, draft and "
                                   "cache serve Prometheus /metrics on this port and the next three; 0 = none")
    grace_seconds: float = Field(10.0, ge=0, description="graceful-shutdown drain time on SIGTERM")
    replicas: int = Field(1, ge=1, le=16, description="`up`: target replicas of the default pool on "
                          "loopback (the first on the target port, more after the cache port)")
    dev: bool = Field(False, description="development mode: plaintext between services when no mesh "
                      "certificates are given, and the public default salt_secret is accepted")
    tls_dir: str = Field("", description="mesh certificates from `specmesh certs` (ca.pem, SERVICE.pem, "
                         "SERVICE-key.pem): internal calls use mutual TLS; '' = none (needs --dev)")
    tls_ca: str = Field("", description="mesh CA certificate (PEM); '' = tls_dir/ca.pem")
    tls_cert: str = Field("", description="this service's mesh certificate (PEM); '' = tls_dir/SERVICE.pem")
    tls_key: str = Field("", description="this service's mesh private key (PEM); '' = tls_dir/SERVICE-key.pem")
    public_tls_cert: str = Field("", description="certificate chain (PEM) for TLS on the router's public "
                                 "port; '' = plaintext")
    public_tls_key: str = Field("", description="private key (PEM) for TLS on the router's public port")
    router_ca: str = Field("", description="CA certificate (PEM) the clients verify the router's public "
                           "TLS with; '' = plaintext")


# ---- the flat names of a tree ------------------------------------------------
@cache
def setting_fields(tree: type[BaseModel]) -> dict[str, tuple[tuple[str, ...], FieldInfo]]:
    """Flat setting name -> (path of field names in `tree`, its declaration), for every leaf
    of the tree (a field whose type is a SettingsGroup is a group, not a setting)."""
    found: dict[str, tuple[tuple[str, ...], FieldInfo]] = {}

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, SettingsGroup):
                walk(field.annotation, (*path, name))
                continue
            flat = field.alias or name
            if flat in found:
                raise TypeError(f"setting {flat!r} is declared twice ({'.'.join(found[flat][0])} and "
                                f"{'.'.join((*path, name))}): flat names must be unique")
            found[flat] = ((*path, name), field)

    walk(tree, ())
    return found


def setting_value(settings: BaseModel, name: str) -> Any:
    """The value of the setting with flat name `name` (`num_blocks` -> settings.target.num_blocks)."""
    value: Any = settings
    for part in setting_fields(type(settings))[name][0]:
        value = getattr(value, part)
    return value


def setting_help(tree: type[BaseModel], name: str) -> str:
    """Help text of one setting: description, default, environment variable."""
    field = setting_fields(tree)[name][1]
    return f"{field.description} (default {field.default!r}; env {ENV_PREFIX}{name.upper()})"


# ---- reading ----------------------------------------------------------------
def read_settings(environ: dict[str, str] | None = None, *, tree: type[BaseModel] = MeshSettings,
                  others_ok: bool = False, **overrides: Any):
    """Defaults < config file < SPECMESH_<NAME> variables < overrides (CLI flags; None = unset),
    by flat name, into `tree` (services/settings.py reads the whole tree; a common tool that
    needs only the mesh-wide settings reads MeshSettings with `others_ok`: config-file keys of
    the services' groups are then passed over instead of refused)."""
    environ = os.environ if environ is None else environ
    fields = setting_fields(tree)
    flags = {name: value for name, value in overrides.items() if value is not None}
    unknown = sorted(set(flags) - set(fields))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
    env = _from_environ(environ, fields)
    path = flags.get("config") or env.get("config", "")
    layers = [("config file " + path, _from_config_file(path, fields, others_ok) if path else {}),
              ("environment", env), ("flag", flags)]
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, values in layers:
        for name, value in values.items():
            merged[name], origin[name] = value, source
    nested: dict[str, Any] = {}
    for name, value in merged.items():  # flat name -> its place in the tree
        place = nested
        for group in fields[name][0][:-1]:
            place = place.setdefault(group, {})
        place[name] = value
    try:
        return tree(**nested)
    except ValidationError as exc:
        raise ValueError(_explain(exc, merged, origin)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The whole mesh config file (YAML mapping); `settings:` is read here, other keys elsewhere."""
    import yaml

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping at the top level")
    return data


def check_declared(group: type[SettingsGroup], owner: object, names: tuple[str, ...]) -> None:
    """Checks `owner`'s attributes `names` (a service config built without the settings, as
    tests and benchmarks do) against their declaration in `group`, so each limit and allowed
    list is written once; ValueError names the field and what is allowed."""
    values = {name: getattr(owner, name) for name in names}
    try:
        group.model_validate(values)
    except ValidationError as exc:
        raise ValueError("; ".join(f"{type(owner).__name__}.{error['loc'][0]}="
                                   f"{values.get(error['loc'][0])!r}: {error['msg']}"
                                   for error in exc.errors())) from None


# ---- helpers ----------------------------------------------------------------
def _from_environ(environ, fields) -> dict[str, str]:
    values = {}
    for name in fields:
        raw = environ.get(f"{ENV_PREFIX}{name.upper()}")
        if raw is None and name in _ENV_ALIASES:
            raw = environ.get(_ENV_ALIASES[name])
        if raw is not None:
            values[name] = raw
    return values


def _from_config_file(path: str, fields, others_ok: bool) -> dict[str, Any]:
    section = read_config_file(path).get("settings") or {}
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: `settings:` must be a mapping")
    if "config" in section:
        raise ValueError(f"config file {path}: `config` cannot be set inside a config file")
    values = {str(k).replace("-", "_"): v for k, v in section.items()}
    unknown = sorted(set(values) - set(fields))
    if unknown and not others_ok:
        raise ValueError("; ".join(f"unknown setting {name!r} (from config file {path})" for name in unknown))
    return {name: value for name, value in values.items() if name in fields}


def _explain(exc: ValidationError, merged: dict, origin: dict) -> str:
    lines = []
    for error in exc.errors():
        name = str(error["loc"][-1]) if error["loc"] else "?"  # a leaf is keyed by its flat name
        where = origin.get(name, "default")
        if where == "environment":
            where = f"{ENV_PREFIX}{name.upper()}"
        elif where == "flag":
            where = f"--{name.replace('_', '-')}"
        lines.append(f"invalid setting {name}={merged.get(name)!r} (from {where}): {error['msg']}")
    return "; ".join(lines)
