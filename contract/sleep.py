"""What the engine and its callers (operator, router, benches) agree on for vLLM-compatible sleep mode (stdlib only).

An engine started with `--enable-sleep-mode` (`SLEEP_MODE_FLAG`) serves vLLM's three admin endpoints:

    POST /sleep?level=1|2      level 1 (default): KV cache memory released, prefix cache emptied, weights kept
                               in host memory (on a GPU they are copied there; on the CPU they already are);
                               level 2: weights released too, reread from the model files on wake.
                               In-flight requests are aborted (vLLM's default `mode=abort`): their streams end
                               with finish_reason "abort". 200 with an empty body once asleep.
    POST /wake_up[?tags=weights&tags=kv_cache]
                               back to serving; vLLM's optional `tags` are accepted (see `WAKE_TAGS`); the
                               engine wakes whole on any tags (a partial wake is not kept as a state).
    GET  /is_sleeping          {"is_sleeping": bool}

Without the flag the three paths answer 404, as in vLLM. They are admin endpoints: with `--api-key` set they
need the key like every other path. While asleep, generation requests answer 503 with an OpenAI error body
(type "service_unavailable", code `SLEEPING_CODE`); `/health` and `/ready` stay 200: a pool kept asleep on
purpose must stay routed and must not be restarted; whoever put it to sleep wakes it with `POST /wake_up`.
The state is exported as vLLM's gauge `ENGINE_SLEEP_STATE_METRIC{sleep_state=...}` (one series per value of
`SLEEP_STATES`, 1 for the current one and 0 for the others; `awake` is 1 when awake).

Invariants: `SLEEP_LEVELS` are exactly vLLM's; `parse_level` accepts what vLLM's handler accepts (an integer
in the query string, default 1) and names the field in its error.
"""

from __future__ import annotations

from collections.abc import Iterable

from .metrics_names import ENGINE_SLEEP_STATE as ENGINE_SLEEP_STATE_METRIC
from .metrics_names import SLEEP_STATE_LABEL

__all__ = ["ENGINE_SLEEP_STATE_METRIC", "SLEEP_STATE_LABEL"]  # re-exported: the gauge's names, for callers

SLEEP_MODE_FLAG = "enable-sleep-mode"  # the serve flag (contract/serve_flags.py), spelled without "--"

SLEEP_PATH = "/sleep"
WAKE_UP_PATH = "/wake_up"
IS_SLEEPING_PATH = "/is_sleeping"
LEVEL_PARAM = "level"  # query parameter of POST /sleep
TAGS_PARAM = "tags"  # repeated query parameter of POST /wake_up
IS_SLEEPING_KEY = "is_sleeping"  # the one key of GET /is_sleeping's body

SLEEP_LEVELS = (1, 2)
DEFAULT_LEVEL = 1
WAKE_TAGS = ("weights", "kv_cache")

SLEEPING_CODE = "sleeping"  # error.code of a generation request refused (or aborted) because the engine sleeps (503)
AWAKE, WEIGHTS_OFFLOADED, DISCARD_ALL = "awake", "weights_offloaded", "discard_all"
SLEEP_STATES = (AWAKE, WEIGHTS_OFFLOADED, DISCARD_ALL)  # vLLM's label values: level 0 (awake), 1, 2


def parse_level(raw: str | None) -> int:
    """The sleep level of `?level=` (absent: `DEFAULT_LEVEL`); ValueError naming the field otherwise."""
    if raw is None or raw == "":
        return DEFAULT_LEVEL
    try:
        level = int(raw)
    except ValueError:
        level = -1
    if level not in SLEEP_LEVELS:
        raise ValueError(f"{LEVEL_PARAM}: expected one of {list(SLEEP_LEVELS)}, got {raw!r}")
    return level


def parse_tags(raw: Iterable[str]) -> tuple[str, ...]:
    """The `?tags=` of POST /wake_up (empty: everything); ValueError naming the field for an unknown tag."""
    tags = tuple(t for value in raw for t in value.split(",") if t)
    unknown = [t for t in tags if t not in WAKE_TAGS]
    if unknown:
        raise ValueError(f"{TAGS_PARAM}: expected any of {list(WAKE_TAGS)}, got {unknown}")
    return tags


def sleep_state(level: int) -> str:
    """The `sleep_state` label value that is 1 at `level` (0 = awake)."""
    return SLEEP_STATES[level]
