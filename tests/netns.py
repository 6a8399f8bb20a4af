"""Hosts of their own on one machine: each service in its own network namespace with its
own address and a DNS name in /etc/hosts (needs root and `ip netns`).

`Hosts` owns the test's /etc/hosts lines (tagged, removed on exit even on failure);
`NetnsHost` is one namespace joined to the root namespace by a veth pair
(root side 10.231.N.1, namespace side 10.231.N.2), deleted on exit. Processes started with
`NetnsHost.popen` run inside the namespace and are killed on exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

HOSTS_FILE = Path("/etc/hosts")


def netns_available() -> str:
    """'' when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    name = f"specmesh-probe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


class Hosts:
    """Name -> address lines this test adds to /etc/hosts (written in place: it may be a mount)."""

    def __init__(self) -> None:
        self.tag = f"# specmesh-test-{os.getpid()}"
        self._lines: list[tuple[str, str]] = []

    def add(self, address: str, name: str) -> None:
        self._lines.append((address, name))
        self._write()

    def remove(self, address: str, name: str) -> None:
        self._lines.remove((address, name))
        self._write()

    def _write(self) -> None:
        kept = [line for line in HOSTS_FILE.read_text().splitlines() if not line.endswith(self.tag)]
        ours = [f"{address} {name} {self.tag}" for address, name in self._lines]
        HOSTS_FILE.write_text("\n".join(kept + ours) + "\n")

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self._lines.clear()
        self._write()


class NetnsHost:
    def __init__(self, index: int) -> None:
        self.name = f"specmesh-{os.getpid()}-{index}"
        self.veth = f"smv{os.getpid() % 100000}x{index}"[:15]
        self.address = f"10.231.{index}.2"
        self._root_address = f"10.231.{index}.1"
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "NetnsHost":
        try:
            for command in (["ip", "netns", "add", self.name],
                            ["ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.name],
                            ["ip", "addr", "add", f"{self._root_address}/24", "dev", self.veth],
                            ["ip", "link", "set", self.veth, "up"],
                            *(["ip", "netns", "exec", self.name, *c] for c in (
                                ["ip", "addr", "add", f"{self.address}/24", "dev", "eth0"],
                                ["ip", "link", "set", "eth0", "up"], ["ip", "link", "set", "lo", "up"]))):
                subprocess.run(command, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            raise RuntimeError(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from None
        return self

    def popen(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._procs.append(proc)
        return proc

    def __exit__(self, *exc) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
