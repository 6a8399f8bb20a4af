"""Generated gRPC code matches protos/ (regenerate with `python scripts/gen_protos.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "specmesh" / "proto"


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


def test_protos_pass_buf_standard_lint():
    """protos/buf.yaml: buf's STANDARD rules (the `buf-bin` package in the test extra ships buf)."""
    import shutil
    import subprocess
    buf = shutil.which("buf")
    assert buf, "buf is not installed: pip install -e .[test] (buf-bin)"
    result = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


async def test_reflection_v1_and_v1alpha():
    import grpc
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    from tests.mesh import start_draft
    server = await start_draft()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            for version in ("v1", "v1alpha"):
                call = channel.stream_stream(
                    f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
                requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                            reflection_pb2.ServerReflectionRequest(file_containing_symbol="specmesh.v1.DraftService"),
                            reflection_pb2.ServerReflectionRequest(
                                file_containing_symbol="grpc.reflection.v1.ServerReflection")]
                listed, draft, v1 = [r async for r in call(iter(requests))]
                assert sorted(s.name for s in listed.list_services_response.service) == [
                    "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection", "specmesh.v1.DraftService"]
                names = {descriptor_pb2.FileDescriptorProto.FromString(f).name
                         for f in draft.file_descriptor_response.file_descriptor_proto}
                assert "specmesh/v1/draft_service.proto" in names, version
                v1_file = descriptor_pb2.FileDescriptorProto.FromString(
                    v1.file_descriptor_response.file_descriptor_proto[0])
                assert (v1_file.name, v1_file.package) == ("grpc/reflection/v1/reflection.proto",
                                                           "grpc.reflection.v1")
    finally:
        await server.stop(0)
