"""Emitting several tokens of one request in one step, exactly as plain decoding would have.

The scheduler already stopped at the first token that hits EOS, a stop token, max_tokens or
max_model_len. Stop *strings* are found by the detokenizer, so the step's tokens are fed to it
one at a time; when a stop string completes before the last of them, the tokens after it are
dropped from the request (they were never emitted), and if the scheduler had finished the
request on one of those later tokens, the stop string is the real reason.
"""

from __future__ import annotations

from ..detokenizer import IncrementalDetokenizer, StopMatch
from ..request import Request, RequestStatus


def feed_tokens(detokenizer: IncrementalDetokenizer, request: Request, tokens: list[int]) -> StopMatch | None:
    if len(tokens) == 1:
        return detokenizer.update(tokens)
    for index, token in enumerate(tokens):
        match = detokenizer.update([token])
        if match is None:
            continue
        num_after = len(tokens) - index - 1
        if num_after:
            del request.output_token_ids[-num_after:]
            del tokens[index + 1 :]
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_token_id = None
        return match
    return None
