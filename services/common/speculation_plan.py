"""What a speculation plan may say, declared once for every service that reads plans: the
router makes them, the target clamps them, the draft service refuses what lies beyond them,
and the settings accept only these values."""

from __future__ import annotations

from typing import Literal, get_args

# Method names as settings and metric labels spell them (SpeculationMethod in common.proto,
# without the prefix, lowercase).
SpeculationMethodName = Literal["off", "prompt_lookup", "suffix", "draft_model", "dynamic_tree", "grammar", "eagle"]
SPECULATION_METHODS: tuple[str, ...] = get_args(SpeculationMethodName)

# "fixed": every request gets the configured plan; "adaptive": depth per bucket and per step
# from predicted and measured acceptance, load and step times.
SpeculationPolicyMode = Literal["fixed", "adaptive"]
POLICY_MODES: tuple[str, ...] = get_args(SpeculationPolicyMode)

MAX_DEPTH = 16  # longest draft path (tokens) a plan may ask for
MAX_NODES = 64  # largest draft tree (nodes) a plan may ask for; 0 = a chain of max_depth nodes
