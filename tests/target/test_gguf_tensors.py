"""The GGUF tensor index (services/target/model/gguf_tensors.py) maps every tensor as gguf's own
reader does, steps over metadata of every value type (a vocabulary of strings included) and
refuses a file that is not a GGUF or ends early."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quantize

from services.target.model.gguf_tensors import read_tensors


def _write(path, alignment: int | None = None) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "gemma3")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "tiny")
    writer.add_uint32("gemma3.block_count", 2)
    writer.add_float32("gemma3.rope.freq_base", 10000.0)
    writer.add_bool("general.flag", True)
    writer.add_uint64("general.count", 7)
    writer.add_int8("general.small", -3)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5) for i in range(3000)])  # "" too
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    writer.add_array("tokenizer.ggml.token_type", [i % 3 for i in range(3000)])
    writer.add_array("general.nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    q8 = quantize(rng.standard_normal((8, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    q5 = quantize(rng.standard_normal((4, 96), dtype=np.float32), GGMLQuantizationType.Q5_0)
    writer.add_tensor("blk.1.ffn_up.weight", q5, raw_dtype=GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_index_maps_every_tensor_as_ggufs_reader_does(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    _write(path, alignment)
    ours = read_tensors(path)
    theirs = GGUFReader(path).tensors
    assert list(ours) == [t.name for t in theirs]
    for t in theirs:
        o = ours[t.name]
        assert o.tensor_type == t.tensor_type
        assert o.shape == tuple(reversed(t.shape.tolist()))
        assert o.data.dtype == t.data.dtype and o.data.shape == t.data.shape
        assert np.array_equal(o.data, t.data)


def test_a_file_that_is_not_a_gguf_or_ends_early_is_refused(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    data = path.read_bytes()
    (tmp_path / "other.gguf").write_bytes(b"NOPE" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_tensors(tmp_path / "other.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:200])  # inside the first values
    with pytest.raises(ValueError, match="ends inside its header"):
        read_tensors(tmp_path / "header.gguf")
    (tmp_path / "vocabulary.gguf").write_bytes(data[:data.index(b"tok100") + 3])  # inside the vocabulary
    with pytest.raises(ValueError, match="ends inside its header"):
        read_tensors(tmp_path / "vocabulary.gguf")
    (tmp_path / "tensors.gguf").write_bytes(data[:-100])  # the last tensor's bytes cut
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_tensors(tmp_path / "tensors.gguf")
