"""Request buckets: the unit the router measures and plans speculation for.

A bucket is `task-length-mode`:
- task: `structured` when the request carries an output constraint (JSON schema, regex, choice,
  grammar: tool calls and extraction); else what the prompt asks for, from cheap text cues — `rewrite` (edit, rename, refactor,
  translate, fix: output copies the input), `summarize`, `code` (source in the prompt),
  `chat` (everything else). The cues decide only how requests are grouped for statistics;
  a wrong guess costs speed, never correctness.
- length: `short` / `long` prompt (2,000 characters).
- mode: `greedy` / `sampled`.
"""

from __future__ import annotations

import re

from services.common.sampling_params import SamplingConfig

LONG_PROMPT_CHARS = 2000
_REWRITE = re.compile(r"\b(rewrite|rephrase|rename|refactor|edit|translate|fix|correct|convert)\b", re.I)
_SUMMARIZE = re.compile(r"\b(summari[sz]e|summary|tl;?dr|key points)\b", re.I)
_CODE = re.compile(r"(```|^\s*(def|class|import|from|function|fn|func|public|#include)\b|[;{}]\s*$)", re.M)


def task_of(prompt: str) -> str:
    if _REWRITE.search(prompt):
        return "rewrite"
    if _SUMMARIZE.search(prompt):
        return "summarize"
    if _CODE.search(prompt):
        return "code"
    return "chat"


def bucket_of(prompt: str, sampling: SamplingConfig, structured: bool = False) -> str:
    length = "short" if len(prompt) < LONG_PROMPT_CHARS else "long"
    mode = "greedy" if sampling.greedy else "sampled"
    return f"{'structured' if structured else task_of(prompt)}-{length}-{mode}"
