"""Request buckets group requests by task, prompt length and sampling mode."""

from __future__ import annotations

from services.common.sampling_params import SamplingConfig
from services.router.buckets import bucket_of, task_of

GREEDY = SamplingConfig(max_tokens=8)
SAMPLED = SamplingConfig(max_tokens=8, temperature=1.0)


def test_tasks_from_text_cues():
    assert task_of("Rewrite this function, renaming x to y:\ndef f(x):\n    return x") == "rewrite"
    assert task_of("Document: ...\nSummarize the document above.") == "summarize"
    assert task_of("def parse(path):\n    result = {}\n") == "code"
    assert task_of("int main() {\n  return 0;\n}") == "code"
    assert task_of("What are good ways to spend a rainy weekend?") == "chat"


def test_bucket_has_task_length_and_mode():
    assert bucket_of("Hello there", GREEDY) == "chat-short-greedy"
    assert bucket_of("Write a poem about the sea.", SAMPLED) == "chat-short-sampled"
    assert bucket_of("Summarize: " + "word " * 500, GREEDY) == "summarize-long-greedy"
