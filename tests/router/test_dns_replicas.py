"""dns:/// replica entries: each resolved address is a replica named by its forward-confirmed
reverse name (else the address); a vanished address is dropped, a resolver failure keeps
the last answer. Names come from /etc/hosts lines this test writes and removes."""

from __future__ import annotations

import os

import pytest

from services.common.dns_replicas import DnsReplicas, split_dns_entry
from tests.netns import Hosts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="writes /etc/hosts (needs root)")
POOL = "pool.dns-replicas.specmesh.test"


async def test_addresses_become_named_replicas_and_leave_with_dns():
    with Hosts() as hosts:
        hosts.add("127.0.0.11", "t0.dns-replicas.specmesh.test")  # the pod's own name first (reverse)
        hosts.add("127.0.0.11", POOL)
        hosts.add("127.0.0.12", POOL)  # no name of its own: known by its address
        found = DnsReplicas(["127.0.0.1:9000", f"dns:///{POOL}:50052"])
        assert await found.expand() == ["127.0.0.1:9000", "t0.dns-replicas.specmesh.test:50052",
                                        "127.0.0.12:50052"]
        hosts.remove("127.0.0.12", POOL)
        assert await found.expand() == ["127.0.0.1:9000", "t0.dns-replicas.specmesh.test:50052"]
        hosts.remove("127.0.0.11", POOL)  # the name no longer resolves: keep the last answer
        assert await found.expand() == ["127.0.0.1:9000", "t0.dns-replicas.specmesh.test:50052"]
    assert POOL not in open("/etc/hosts").read()


async def test_changes_are_what_to_add_and_drop_against_the_callers_set():
    """The one resolution step the router's replicas, its cache instances and the cache's
    prefix index share: identities DNS names now that the caller lacks, and the reverse."""
    with Hosts() as hosts:
        hosts.add("127.0.0.11", POOL)
        hosts.add("127.0.0.12", POOL)
        found = DnsReplicas(["127.0.0.1:9000", f"dns:///{POOL}:50052"])
        known = {"127.0.0.1:9000": 0}
        added, removed = await found.changes(known.keys())
        assert (added, removed) == (["127.0.0.11:50052", "127.0.0.12:50052"], [])
        known.update(dict.fromkeys(added, 0))
        hosts.remove("127.0.0.11", POOL)
        hosts.add("127.0.0.13", POOL)
        assert await found.changes(known.keys()) == (["127.0.0.13:50052"], ["127.0.0.11:50052"])
    assert await DnsReplicas(["127.0.0.1:9000"]).changes({}) == ([], [])  # nothing to resolve


def test_bad_dns_entries_are_refused():
    for entry in ("dns:///nameonly", "dns:///name:0", "dns:///:50052"):
        with pytest.raises(ValueError, match="is not dns:///NAME:PORT"):
            DnsReplicas([entry])
    assert split_dns_entry("dns:///a.b:7") == ("a.b", 7)
