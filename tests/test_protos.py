"""Generated gRPC code matches protos/ (regenerate with `python scripts/gen_protos.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "services" / "common" / "proto"


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path):
    fresh = tmp_path / "proto"
    _gen_module().generate(fresh)
    fresh_files = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*.py*") if p.is_file()}
    committed = {p.relative_to(GENERATED): p.read_text() for p in GENERATED.rglob("*.py*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert set(fresh_files) == set(committed), "run: python scripts/gen_protos.py"
    stale = [str(p) for p in fresh_files if fresh_files[p] != committed[p]]
    assert not stale, f"stale generated files {stale}; run: python scripts/gen_protos.py"


def test_protos_follow_the_house_style():
    for proto in (ROOT / "protos" / "specmesh" / "v1").glob("*.proto"):
        text = proto.read_text()
        assert "package specmesh.v1;" in text, proto
        lines = text.splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("service "):
                assert stripped.split()[1].endswith("Service"), stripped
            if stripped.startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}: no comment on {stripped}"
                assert "Errors:" in "\n".join(lines[max(0, i - 12):i]), f"{proto.name}: no status codes on {stripped}"
            if stripped.startswith("enum "):
                name = stripped.split()[1]
                assert "_UNSPECIFIED = 0" in lines[i + 1], f"{name} zero value must be *_UNSPECIFIED"
