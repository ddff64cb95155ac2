"""Unit tests of the pure routing code: hash ring, policies, hot fallback, prefix keys, static URLs, slices."""

from __future__ import annotations

import collections

import pytest

from tidepool.router.discovery import endpoints_from_slices, parse_static_url
from tidepool.router.policy import (
    HashRing,
    HotThresholds,
    LeastLoadPolicy,
    PrefixAwarePolicy,
    ReplicaLoad,
    RoundRobinPolicy,
    make_policy,
)
from tidepool.router.pool import Endpoint
from tidepool.router.prefix import prefix_key, prompt_text

IDS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def loads(**overrides: dict[str, int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica_id, **overrides.get(replica_id, {})) for replica_id in IDS]


def test_ring_spreads_keys_and_moves_only_the_removed_replicas_keys() -> None:
    keys = [f"key-{i}".encode() for i in range(4000)]
    ring = HashRing(IDS)
    owners = {k: ring.lookup(k) for k in keys}
    counts = collections.Counter(owners.values())
    assert set(counts) == set(IDS)
    assert max(counts.values()) < 1.5 * min(counts.values())  # virtual nodes keep the split even
    smaller = HashRing(IDS[:3])
    for key, owner in owners.items():
        if owner != IDS[3]:
            assert smaller.lookup(key) == owner  # consistent: only the removed replica's keys move
        else:
            assert smaller.lookup(key) in IDS[:3]


def test_ring_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_virtual_nodes"):
        HashRing(IDS, 0)
    with pytest.raises(ValueError, match="at least one"):
        HashRing([])


def test_round_robin_cycles_in_id_order() -> None:
    policy = RoundRobinPolicy()
    picks = [policy.choose(loads(), None).replica_id for _ in range(8)]
    assert picks == sorted(IDS) * 2


def test_least_load_uses_queue_then_kv_usage_then_dispatch_count() -> None:
    policy = LeastLoadPolicy()
    view = loads(**{IDS[0]: {"num_running": 3}, IDS[1]: {"num_waiting": 2}, IDS[2]: {"num_running": 1, "kv_usage": 0.1},
                    IDS[3]: {"num_running": 1, "kv_usage": 0.5}})  # fmt: skip
    assert policy.choose(view, None).replica_id == IDS[2]
    # The router's own in-flight count counts when the scrape lags behind it.
    view = loads(**{IDS[0]: {"num_inflight": 5}, IDS[1]: {"num_dispatched": 3}, IDS[2]: {"num_dispatched": 1},
                    IDS[3]: {"num_dispatched": 2}})  # fmt: skip
    assert policy.choose(view, None).replica_id == IDS[2]


def test_prefix_aware_is_sticky_and_falls_back_when_the_target_is_hot() -> None:
    policy = PrefixAwarePolicy(HotThresholds(max_waiting=4, load_ratio=2.0, load_slack=4))
    key = prefix_key("a shared system prompt " * 20)
    target = policy.choose(loads(), key)
    assert target.reason == "prefix"
    assert all(policy.choose(loads(), key).replica_id == target.replica_id for _ in range(5))
    # Moderately busier than the rest: still the target (a prefix hit is worth a little queueing).
    view = loads(**{target.replica_id: {"num_running": 4}})
    assert policy.choose(view, key) == target
    # Too many waiting, or load far above the least loaded: least-load instead.
    view = loads(**{target.replica_id: {"num_waiting": 5}})
    fallback = policy.choose(view, key)
    assert fallback.reason == "prefix_fallback" and fallback.replica_id != target.replica_id
    view = loads(**{target.replica_id: {"num_running": 9}})
    assert policy.choose(view, key).reason == "prefix_fallback"
    # No prompt to hash: least-load.
    assert policy.choose(loads(), None).reason == "least_load"


def test_prefix_aware_keys_move_only_when_their_replica_leaves() -> None:
    policy = PrefixAwarePolicy()
    keys = [prefix_key(f"prompt family {i} " * 30) for i in range(200)]
    before = {k: policy.choose(loads(), k).replica_id for k in keys}
    three = [r for r in loads() if r.replica_id != IDS[0]]
    after = {k: policy.choose(three, k).replica_id for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != IDS[0])


def test_make_policy_names() -> None:
    assert isinstance(make_policy("round-robin"), RoundRobinPolicy)
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        make_policy("random")


def test_prefix_key_uses_whole_leading_blocks() -> None:
    shared = "x" * 256
    assert prefix_key(shared + "tail one", 64, 4) == prefix_key(shared + "another, longer tail", 64, 4)
    assert prefix_key("y" + shared[1:], 64, 4) != prefix_key(shared, 64, 4)
    # A partial tail block is left out; a prompt shorter than a block is hashed whole.
    assert prefix_key("z" * 100 + "a", 64, 4) == prefix_key("z" * 100 + "b", 64, 4)
    assert prefix_key("short a", 64, 4) != prefix_key("short b", 64, 4)
    assert prefix_key("", 64, 4) is None and prefix_key(None) is None
    with pytest.raises(ValueError, match="block_chars"):
        prefix_key("abc", 0, 4)


def test_prompt_text_of_completions_and_chat() -> None:
    assert prompt_text("/v1/completions", {"prompt": "hello"}) == "hello"
    assert prompt_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prompt_text("/v1/completions", {"prompt": [5, 6, 7]}) == "5 6 7"
    assert prompt_text("/v1/completions", {"prompt": [[5, 6], [7]]}) == "5 6"
    assert prompt_text("/v1/completions", {}) is None
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert prompt_text("/v1/chat/completions", {"messages": messages}) == "<|system|>be brief\n<|user|>hi\n"
    assert prompt_text("/v1/chat/completions", {"messages": "nope"}) is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = prompt_text("/v1/chat/completions", {"messages": messages, "tools": tools})
    assert with_tools is not None and with_tools.startswith("<|tools|>") and with_tools.endswith("<|user|>hi\n")


def test_parse_static_url() -> None:
    assert parse_static_url("http://h:8000", "--unified-url") == Endpoint("http://h:8000")
    assert parse_static_url("http://h:8000/,kv=h:14579", "--decode-url", True) == Endpoint("http://h:8000", "h:14579")
    for bad, match in (("h:8000", "expected http://HOST:PORT"), ("http://h", "expected"),
                       ("http://h:1/v1", "without a path"), ("http://h:1,kv=h", "kv=HOST:PORT"),
                       ("http://h:1,x=1", "unknown option")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_static_url(bad, "--unified-url")
    with pytest.raises(ValueError, match=r"--decode-url .*needs its KV listener"):
        parse_static_url("http://h:1", "--decode-url", needs_kv=True)


def test_endpoints_from_slices() -> None:
    slices = {
        "items": [
            {
                "metadata": {"name": "decode-abc"},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8000}, {"name": "kv", "port": 14579}],
                "endpoints": [
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": True}},
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
                    {"addresses": ["10.0.0.4"], "conditions": {"ready": False, "terminating": True}},
                ],
            },
            {
                "metadata": {"name": "decode-v6"},
                "addressType": "IPv6",
                "ports": [{"name": "web", "port": 9000}],
                "endpoints": [{"addresses": ["fd00::5"]}],
            },
            {"metadata": {"name": "no-ports"}, "ports": [], "endpoints": [{"addresses": ["10.0.0.9"]}]},
        ]
    }
    assert endpoints_from_slices(slices) == [
        Endpoint("http://10.0.0.2:8000", "10.0.0.2:14579"),
        Endpoint("http://10.0.0.3:8000", "10.0.0.3:14579"),
        Endpoint("http://[fd00::5]:9000", None),  # the only port, though not named http
    ]
    assert endpoints_from_slices({"items": None}) == []
