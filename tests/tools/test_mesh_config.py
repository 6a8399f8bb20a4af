"""Mesh config: YAML -> validated dataclasses; errors name the field."""

from __future__ import annotations

import pytest

from services.common.mesh_config import (
    MeshConfigError,
    Weights,
    default_mesh_config,
    load_mesh_config,
    mesh_config_from_dict,
)

EXAMPLE = """
pools:
  small:
    model: /models/small
    replicas: ["10.0.0.1:50052", "dns:///target-small.specmesh.svc:50052"]
    price_prompt_per_1k: 0.1
    price_completion_per_1k: 0.4
    max_context: 2048
    quality: {"code-*": 0.3, "*": 0.6}
    escalate_to: large
    escalate_buckets: ["chat-*"]
    min_mean_logprob: -2.5
  large:
    replicas: ["10.0.0.2:50052"]
    price_prompt_per_1k: 1
    quality: {"*": 0.9}
tenants:
  acme: {token: secret-1, class: premium, priority: 2, max_concurrent: 8,
         tokens_per_second: 2000, risk_flags: [regulated]}
  bob: {token: secret-2}
classes:
  premium: {cost: 0.1, quality: 5}
risk_rules:
  - {name: ssn, pattern: "\\\\d{3}-\\\\d{2}-\\\\d{4}", force_pool: large}
  - {name: regulated, tenant_flag: regulated, penalty: {small: 10}}
"""


def test_example_file_loads_into_dataclasses(tmp_path):
    path = tmp_path / "mesh.yaml"
    path.write_text(EXAMPLE)
    config = load_mesh_config(path)
    small, large = config.pools
    assert small.replicas == ("10.0.0.1:50052", "dns:///target-small.specmesh.svc:50052")
    assert (small.price_prompt_per_1k, small.price_completion_per_1k, small.max_context) == (0.1, 0.4, 2048)
    assert small.quality_for("code-short-greedy") == 0.3
    assert small.quality_for("chat-short-greedy") == 0.6
    assert small.escalates("chat-long-sampled") and not small.escalates("code-short-greedy")
    assert not large.escalates("chat-short-greedy")
    assert large.model == "default" and large.price_prompt_per_1k == 1.0
    assert config.tokens() == {"secret-1": "acme", "secret-2": "bob"}
    assert config.weights_for("acme") == Weights(cost=0.1, latency=1.0, quality=5.0, risk=1.0)
    assert config.weights_for("bob") == Weights()
    assert config.tenant("acme").priority == 2
    assert config.tenant("acme").risk_flags == ("regulated",)
    ssn, regulated = config.risk_rules
    assert ssn.matches("my ssn is 123-45-6789", ()) and not ssn.matches("hello", ())
    assert regulated.matches("hello", ("regulated",)) and not regulated.matches("hello", ())


@pytest.mark.parametrize("patch, message", [
    ({"pools": {"a": {"replicas": []}}}, "pools.a.replicas: at least one"),
    ({"pools": {"a": {"replicas": ["nohost"]}}}, "pools.a.replicas: 'nohost' is not host:port"),
    ({"pools": {"a": {"replicas": ["h:1"], "price_prompt_per_1k": -1}}}, "pools.a.price_prompt_per_1k: must be >= 0"),
    ({"pools": {"a": {"replicas": ["h:1"], "max_context": "big"}}}, "pools.a.max_context: expected an integer"),
    ({"pools": {"a": {"replicas": ["h:1"], "quality": {"*": 2}}}}, "pools.a.quality.*: must be in [0, 1]"),
    ({"pools": {"a": {"replicas": ["h:1"], "escalate_to": "b"}}}, "pools.a.escalate_to: unknown pool 'b'"),
    ({"pools": {"a": {"replicas": ["h:1"], "colour": 1}}}, "pools.a: unknown field(s) ['colour']"),
    ({"pools": {"a": {"replicas": ["h:1"]}}, "tenants": {"t": {"token": "x", "class": "gold"}}},
     "tenants.t.class: unknown class 'gold'"),
    ({"pools": {"a": {"replicas": ["h:1"]}}, "tenants": {"t": {"token": ""}}}, "tenants.t.token: must not be empty"),
    ({"pools": {"a": {"replicas": ["h:1"]}}, "classes": {"c": {"cost": float("nan")}}}, "classes.c.cost: must be a finite"),
    ({"pools": {"a": {"replicas": ["h:1"]}}, "risk_rules": [{"name": "r", "pattern": "(", "force_pool": "a"}]},
     "risk_rules[0].pattern: not a regular expression"),
    ({"pools": {"a": {"replicas": ["h:1"]}}, "risk_rules": [{"name": "r", "pattern": "x", "force_pool": "z"}]},
     "risk_rules[0] (r): unknown pool 'z'"),
    ({"pools": {}}, "pools: at least one pool"),
    ({"pool": {}}, "top level: unknown field(s) ['pool']"),
])
def test_invalid_configs_name_the_field(patch, message):
    with pytest.raises(MeshConfigError) as info:
        mesh_config_from_dict(patch)
    assert message in str(info.value)


def test_errors_from_a_file_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("pools: {a: {replicas: ['h:1'], max_context: -5}}\n")
    with pytest.raises(MeshConfigError, match=r"bad.yaml: pools.a.max_context: must be >= 0"):
        load_mesh_config(path)
    path.write_text("pools: [unclosed\n")
    with pytest.raises(MeshConfigError, match="not valid YAML"):
        load_mesh_config(path)


def test_without_a_file_one_default_pool():
    config = default_mesh_config(["127.0.0.1:50052"], {"tok": "tenant-a"})
    assert [p.name for p in config.pools] == ["default"]
    assert config.pools[0].replicas == ("127.0.0.1:50052",)
    assert config.tokens() == {"tok": "tenant-a"}
    assert config.weights_for("tenant-a") == Weights()
