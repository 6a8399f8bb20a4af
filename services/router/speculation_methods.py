"""Which speculation methods a bucket may run, per pool: the static mapping the router's
speculation policy (services/router/speculation_policy.py) chooses among.

The `speculation_methods` setting is a comma-separated list of entries

    [POOL:]BUCKET_GLOB=METHOD[|METHOD...]

e.g. `chat-*=eagle|prompt_lookup, small:rewrite-*=suffix, structured-*=grammar`. The first
entry whose glob matches the bucket (and whose pool, when named, is the request's) gives the
candidates, in order of preference; with one candidate the method is static, with several
the policy measures each and settles on the best. In the config file the value may also be a
mapping (`{"chat-*": "eagle|prompt_lookup"}` or `{"chat-*": [eagle, prompt_lookup]}`).

The entries given come first; the defaults follow (`default_entries`), so a bucket no entry
names still gets the method it got before: grammar drafts for constrained requests
(`structured-*`), the feature head and prompt lookup for open text (`chat-*`) where an eagle
head serves the pool, prompt lookup and suffix decoding where the answer copies its context.

`--speculation-method X` (anything but `auto`) overrides the mapping for every bucket
(`MethodMap.forced`), constrained requests still getting grammar drafts unless X is `off`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.speculation_plan import SPECULATION_METHODS

AUTO = "auto"  # the speculation_method setting's value that lets the mapping choose
STRUCTURED = "structured-*"  # buckets of requests with an output constraint (services/router/buckets.py)
COPY_TASKS = ("rewrite-*", "summarize-*", "code-*")  # the answer copies its context


@dataclass(frozen=True)
class MethodEntry:
    pattern: str  # bucket glob
    methods: tuple[str, ...]  # candidates, preferred first
    pool: str = ""  # "" = every pool

    def matches(self, pool: str, bucket: str) -> bool:
        return (not self.pool or self.pool == pool) and fnmatch.fnmatchcase(bucket, self.pattern)

    def spec(self) -> str:
        return f"{self.pool + ':' if self.pool else ''}{self.pattern}={'|'.join(self.methods)}"


@dataclass(frozen=True)
class MethodMap:
    entries: tuple[MethodEntry, ...]

    def candidates(self, pool: str, bucket: str) -> tuple[str, ...]:
        """The methods `bucket` may run on `pool`, preferred first; ("off",) when none matches.
        Grammar drafts need a constraint: elsewhere `grammar` reads as off. `off` beside other
        methods is dropped (the adaptive depth already turns a method off where it does not pay)."""
        for entry in self.entries:
            if entry.matches(pool, bucket):
                structured = fnmatch.fnmatchcase(bucket, STRUCTURED)
                methods = tuple(dict.fromkeys(
                    "off" if m == "grammar" and not structured else m for m in entry.methods))
                return tuple(m for m in methods if m != "off") or ("off",)  # off: only alone
        return ("off",)

    @classmethod
    def forced(cls, method: str) -> MethodMap:
        """`--speculation-method X`: X for every bucket; constrained requests get grammar drafts
        unless X is off, and under `grammar` only they speculate."""
        if method not in SPECULATION_METHODS:
            raise ValueError(f"speculation method must be one of {SPECULATION_METHODS}, got {method!r}")
        structured = "off" if method == "off" else "grammar"
        return cls((MethodEntry(STRUCTURED, (structured,)), MethodEntry("*", (method,))))

    @classmethod
    def configured(cls, spec: str, eagle_pools: Iterable[str] = (), pools: Iterable[str] | None = None
                   ) -> MethodMap:
        """The `speculation_methods` entries, then the defaults. `eagle_pools`: pools whose
        draft service serves a feature head for their model; `pools`: the mesh's pool names
        (an entry naming another is refused)."""
        entries = parse_entries(spec)
        if pools is not None:
            known = set(pools)
            for entry in entries:
                if entry.pool and entry.pool not in known:
                    raise ValueError(f"speculation_methods: entry {entry.spec()!r} names unknown pool "
                                     f"{entry.pool!r}; the mesh's pools are {sorted(known)}")
        return cls(entries + default_entries(eagle_pools))


def default_entries(eagle_pools: Iterable[str] = ()) -> tuple[MethodEntry, ...]:
    """Grammar drafts for constrained requests; for open text the feature head (where one
    serves the pool) beside prompt lookup; prompt lookup and suffix decoding for answers that
    copy their context; prompt lookup elsewhere (as every bucket had before)."""
    return (MethodEntry(STRUCTURED, ("grammar",)),
            *(MethodEntry("chat-*", ("eagle", "prompt_lookup"), pool) for pool in eagle_pools),
            *(MethodEntry(pattern, ("prompt_lookup", "suffix")) for pattern in COPY_TASKS),
            MethodEntry("*", ("prompt_lookup",)))


def parse_entries(spec: str) -> tuple[MethodEntry, ...]:
    """Parses `[POOL:]GLOB=METHOD[|METHOD...],...`; ValueError names the bad entry."""
    entries = []
    for raw in filter(None, (part.strip() for part in spec.split(","))):
        left, sep, right = raw.partition("=")
        pool, colon, pattern = left.strip().rpartition(":")
        pool, pattern = pool.strip(), pattern.strip()
        methods = tuple(m.strip() for m in right.split("|"))
        if not sep or not pattern or (colon and not pool) or not all(methods):
            raise ValueError(f"speculation_methods: bad entry {raw!r}; expected "
                             "[POOL:]BUCKET_GLOB=METHOD[|METHOD...]")
        unknown = [m for m in methods if m not in SPECULATION_METHODS]
        if unknown:
            raise ValueError(f"speculation_methods: entry {raw!r}: unknown method(s) {unknown}; "
                             f"expected some of {list(SPECULATION_METHODS)}")
        if len(set(methods)) != len(methods):
            raise ValueError(f"speculation_methods: entry {raw!r} names a method twice")
        entries.append(MethodEntry(pattern, methods, pool))
    return tuple(entries)


def spec_of(value: object) -> object:
    """The setting's text from a config-file mapping ({glob: "m1|m2"} or {glob: [m1, m2]});
    anything else is returned as it is (the setting's validation judges it)."""
    if not isinstance(value, dict):
        return value
    parts = []
    for pattern, methods in value.items():
        if isinstance(methods, (list, tuple)):
            methods = "|".join(str(m) for m in methods)
        parts.append(f"{pattern}={methods}")
    return ",".join(parts)
