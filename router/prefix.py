"""The prefix key of a request: what prefix-aware routing hashes. Pure code.

The router has no tokenizer, so it works on characters. The text hashed is:
- `/v1/completions`: the prompt string (the first one when `prompt` is a list of strings;
  token-id prompts are written as their decimal ids joined by spaces);
- `/v1/chat/completions`: the messages rendered as `<|role|>content\\n` one after another
  (text parts of list contents concatenated; other parts ignored), so the system prompt
  and the earlier turns come first, as they do in every chat template; a request with `tools`
  starts with them (`<|tools|>` + their JSON, keys sorted), as templates render tools first.

That text is cut into blocks of `block_chars` characters (64 by default, ~16 BPE tokens of
English) and the key is a hash of its first `max_blocks` full blocks (4 by default, 256
characters). A partial last block is left out when at least one full block exists, so
prompts that share their leading blocks but differ in a short tail get the same key; a
prompt shorter than one block is hashed whole. Requests whose shared prefix (e.g. a system
prompt) is at least `block_chars * max_blocks` characters long therefore meet on one replica.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def prompt_text(path: str, body: dict[str, Any]) -> str | None:
    """The text a request's prompt starts with, or None when there is nothing to hash."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        # Chat templates render the tools first: requests sharing tools share that prefix of the engine's cache.
        tools = body.get("tools")
        head = f"<|tools|>{json.dumps(tools, sort_keys=True)}\n" if isinstance(tools, list) and tools else ""
        return head + "".join(_render_message(m) for m in messages if isinstance(m, dict)) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: route on its first prompt
    if isinstance(prompt, str):
        return prompt or None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(str(t) for t in prompt)
    return None


def _render_message(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    if not isinstance(content, str):
        content = ""
    return f"<|{message.get('role', '')}|>{content}\n"


def prefix_key(text: str | None, block_chars: int = 64, max_blocks: int = 4) -> bytes | None:
    """The hash of `text`'s first full blocks (at most `max_blocks`); the whole text if shorter than a block."""
    if block_chars < 1 or max_blocks < 1:
        raise ValueError(f"block_chars and max_blocks must be >= 1, got {block_chars} and {max_blocks}")
    if not text:
        return None
    num_blocks = min(len(text) // block_chars, max_blocks)
    head = text[: num_blocks * block_chars] if num_blocks else text
    return hashlib.blake2b(head.encode("utf-8", "surrogatepass"), digest_size=16).digest()
