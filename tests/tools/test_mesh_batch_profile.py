"""benchmarks/mesh_batch_profile.py: py-spy's raw stacks sorted into the parts of a step."""

from __future__ import annotations

from benchmarks.mesh_batch_profile import categorize, read_raw


def test_a_sample_counts_in_the_most_specific_part_its_stack_shows(tmp_path):
    lm_head = ("run (asyncio/runners.py:118);_execute (services/target/engine/engine.py:552);"
               "__call__ (services/target/model/output_layer.py:40);bf16_linear (services/target/kernels/cpu_linear.py:32)")
    layer = ("_execute (services/target/engine/engine.py:552);_call_row_ops (services/target/model/gemma3_forward.py:256);"
             "bf16_linear (services/target/kernels/cpu_linear.py:32)")
    emit = "run (asyncio/runners.py:118);emit (services/target/server/service.py:87)"
    idle_loop = "run (asyncio/runners.py:118);_run_once (asyncio/base_events.py:1884)"
    assert categorize(lm_head) == "output layer (lm_head)"  # not "linear kernels", nor the engine
    assert categorize(layer) == "linear kernels"
    assert categorize(emit) == "stream to the caller"
    assert categorize(idle_loop) == "asyncio"
    assert categorize("main (tool.py:1)") == "other"
    raw = tmp_path / "target.txt"
    raw.write_text(f"{lm_head} 7\n{layer} 3\n{emit} 2\n")
    assert read_raw(raw) == {"output layer (lm_head)": 7, "linear kernels": 3, "stream to the caller": 2}
    assert read_raw(tmp_path / "missing.txt") == {}
