"""GenerateChunk.logprobs from the engine's TokenLogprobs, with each token's text piece."""

from __future__ import annotations

from specmesh.proto.v1 import common_pb2


class TokenTexts:
    """Token id -> its text piece (special tokens included), decoded once per id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # bounded by the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def logprobs_proto(logprobs: list | None, texts: TokenTexts) -> list[common_pb2.TokenLogprob]:
    """logprobs: [num_tokens] services/target/model/logprobs.TokenLogprob, or None (none asked)."""
    return [common_pb2.TokenLogprob(
        token_id=lp.token_id, token=texts(lp.token_id), logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, token=texts(t), logprob=v) for t, v in lp.top])
        for lp in logprobs or ()]
