"""The methods a bucket may run per pool (the `speculation_methods` mapping, its defaults and the
forced `--speculation-method`), and the policy's choice among them: explore the unmeasured on a
share of requests, then keep the best measured."""

from __future__ import annotations

import pytest
import yaml

from services.common.mesh_config import MeshConfig, PoolConfig
from services.router.config import RouterConfig
from services.router.speculation_methods import MethodMap, parse_entries
from services.router.speculation_policy import PolicyConfig, SpeculationPolicy
from services.settings import read_settings

CHAT, REWRITE, JSON = "chat-short-greedy", "rewrite-long-greedy", "structured-short-greedy"


def _mesh(*names: str) -> MeshConfig:
    return MeshConfig(pools=tuple(PoolConfig(name=n, replicas=(f"127.0.0.1:{5000 + i}",))
                                  for i, n in enumerate(names)))


def test_the_first_matching_entry_gives_the_candidates_and_the_defaults_follow():
    methods = MethodMap.configured("small:chat-*=suffix, chat-*=eagle|prompt_lookup, code-*=off")
    assert methods.candidates("small", CHAT) == ("suffix",)
    assert methods.candidates("large", CHAT) == ("eagle", "prompt_lookup")
    assert methods.candidates("large", "code-short-greedy") == ("off",)
    # Buckets no entry names: the defaults (no eagle head anywhere: prompt lookup for open text).
    assert methods.candidates("large", REWRITE) == ("prompt_lookup", "suffix")
    assert methods.candidates("large", JSON) == ("grammar",)
    assert MethodMap.configured("").candidates("default", CHAT) == ("prompt_lookup",)
    with_head = MethodMap.configured("", eagle_pools=["default"])
    assert with_head.candidates("default", CHAT) == ("eagle", "prompt_lookup")
    assert with_head.candidates("other", CHAT) == ("prompt_lookup",)
    # Grammar drafts need a constraint; off beside another method is dropped.
    assert MethodMap.configured("*=grammar|suffix").candidates("p", CHAT) == ("suffix",)
    assert MethodMap.configured("*=grammar").candidates("p", CHAT) == ("off",)


def test_a_forced_method_applies_to_every_bucket_whatever_the_mapping():
    config = RouterConfig(target_address="t:1", tokens={"t": "a"}, speculation_method="suffix",
                          speculation_methods="chat-*=eagle")
    assert config.method_map.candidates("default", CHAT) == ("suffix",)
    assert config.method_map.candidates("default", JSON) == ("grammar",)  # as before: grammar drafts
    assert MethodMap.forced("off").candidates("default", JSON) == ("off",)
    auto = RouterConfig(target_address="t:1", tokens={"t": "a"}, speculation_methods="chat-*=eagle")
    assert auto.method_map.candidates("default", CHAT) == ("eagle",)


@pytest.mark.parametrize("spec, message", [
    ("chat-*", "bad entry 'chat-\\*'"),
    ("chat-*=medusa", "unknown method\\(s\\) \\['medusa'\\]"),
    ("chat-*=suffix|suffix", "names a method twice"),
    (":chat-*=suffix", "bad entry"),
    ("chat-*=suffix|", "bad entry"),
])
def test_bad_entries_are_refused_naming_the_entry(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_entries(spec)


def test_the_setting_reads_from_flag_names_env_and_a_config_file_mapping(tmp_path):
    settings = read_settings({"SPECMESH_SPECULATION_METHODS": "chat-*=eagle|suffix"})
    assert settings.router.speculation_methods == "chat-*=eagle|suffix"
    assert settings.router.speculation_method == "auto"
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"pools": {"default": {"replicas": ["127.0.0.1:1"]}},
                                    "settings": {"speculation_methods": {"chat-*": ["eagle", "prompt_lookup"],
                                                                         "rewrite-*": "suffix"}}}))
    assert read_settings({"SPECMESH_CONFIG": str(path)}).router.speculation_methods == \
        "chat-*=eagle|prompt_lookup,rewrite-*=suffix"
    with pytest.raises(ValueError, match=r"invalid setting speculation_methods='chat-\*=medusa' "
                                         r"\(from SPECMESH_SPECULATION_METHODS\)"):
        read_settings({"SPECMESH_SPECULATION_METHODS": "chat-*=medusa"})


def test_router_config_refuses_an_entry_or_head_for_an_unknown_pool():
    with pytest.raises(ValueError, match="names unknown pool 'large'"):
        RouterConfig(target_address="", tokens={"t": "a"}, mesh=_mesh("small"),
                     speculation_methods="large:chat-*=eagle")
    with pytest.raises(ValueError, match="eagle_pools: unknown pool"):
        RouterConfig(target_address="", tokens={"t": "a"}, mesh=_mesh("small"), eagle_pools=("large",))
    config = RouterConfig(target_address="", tokens={"t": "a"}, mesh=_mesh("small", "large"),
                          speculation_methods="large:chat-*=eagle")
    assert config.method_map.candidates("large", CHAT) == ("eagle",)


def test_builders_offer_the_head_to_the_target_models_pools_only_when_a_head_is_set():
    from services.builders import router_config
    plain = router_config(read_settings({"SPECMESH_DEV": "true", "SPECMESH_EAGLE_HEAD": "none"}))
    assert plain.eagle_pools == () and plain.method_map.candidates("default", CHAT) == ("prompt_lookup",)
    shipped = router_config(read_settings({"SPECMESH_DEV": "true"}))  # auto: the head shipped for the default model
    assert shipped.eagle_pools == ("default",)
    other = router_config(read_settings({"SPECMESH_DEV": "true", "SPECMESH_MODEL": "/models/other"}))
    assert other.eagle_pools == ()  # auto: no head ships for another model
    headed = router_config(read_settings({"SPECMESH_DEV": "true", "SPECMESH_EAGLE_HEAD": "/heads/h.safetensors"}))
    assert headed.eagle_pools == ("default",)
    assert headed.method_map.candidates("default", CHAT) == ("eagle", "prompt_lookup")


# ---- the choice ---------------------------------------------------------------------------
def _policy(spec: str, mode: str = "fixed", **config) -> SpeculationPolicy:
    return SpeculationPolicy(PolicyConfig(mode=mode, **config), 4, methods=MethodMap.configured(spec))


def test_unmeasured_candidates_are_explored_on_every_fourth_request_in_turn():
    policy = _policy("chat-*=eagle|prompt_lookup|suffix")
    picks = [policy.choose(CHAT, 64, 0.0) for _ in range(12)]
    # eagle's prior (0.5) beats prompt lookup's and suffix's on chat (0.2); every 4th request explores.
    # Turns go to the unmeasured other than the best, in turn (the best is measured as it runs).
    assert [p.method for p in picks] == ["eagle", "eagle", "eagle", "suffix", "eagle", "eagle", "eagle",
                                         "prompt_lookup", "eagle", "eagle", "eagle", "suffix"]
    assert [p.choice for p in picks].count("explore") == 3


def test_the_best_measured_candidate_is_kept_and_pools_measure_apart():
    policy = _policy("chat-*=eagle|prompt_lookup")
    for _ in range(3):
        policy.observe(CHAT, 40, 2, "eagle", "a")
        policy.observe(CHAT, 20, 18, "prompt_lookup", "a")
        policy.observe(CHAT, 40, 36, "eagle", "b")
    assert {policy.choose(CHAT, 64, 0.0, pool="a").method for _ in range(8)} == {"prompt_lookup"}
    assert [policy.choose(CHAT, 64, 0.0, pool="b").method for _ in range(4)][:3] == ["eagle"] * 3
    assert policy.acceptance(CHAT, "eagle", "a") == pytest.approx(0.05)


def test_a_method_the_draft_cannot_serve_counts_as_rejected_and_small_requests_pool():
    policy = _policy("chat-*=eagle|prompt_lookup")
    policy.observe(CHAT, 0, 0, "eagle", fallback_steps=12)  # no head: every step fell back
    assert policy.acceptance(CHAT, "eagle") == 0.0
    for _ in range(3):
        policy.observe(CHAT, 3, 3, "prompt_lookup")  # 3 tokens alone say too little ...
    assert policy.acceptance(CHAT, "prompt_lookup") == pytest.approx(0.999)  # ... 9 together do


def test_an_explored_method_speculates_even_where_its_prior_says_off():
    policy = _policy("chat-*=eagle|prompt_lookup", mode="adaptive")
    picks = [policy.choose("chat-short-sampled", 64, 1.0) for _ in range(4)]
    assert picks[3].method == "prompt_lookup" and picks[3].choice == "explore" and picks[3].depth >= 1
    assert policy.choose(CHAT, 8, 0.0).method == "off"  # tool-call sized: no speculation, no turn taken
