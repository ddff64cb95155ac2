"""The autoscaling simulator's per-tick fluid model of a prefill/decode fleet.

Role: `simulate` plays a `Trace` (autoscale_traces.py) through the prefill and decode pools of
autoscale_fleet.py under one `Controller` and returns SLO attainment, GPU-hours and scale events.

Model per tick, from the tick's request count and prompt/output token totals:
- Prefill: utilization rho = prompt tokens arriving / capacity (capped 0.95); the TTFT of the tick's
  arrivals = (their mean prompt / prefill rate) x 1.5 / (1 - rho) (queueing; p95 ~ 1.5x the mean wait)
  + the backlog's wait beyond a tick. Prefill engines show rho x replicas running and
  rho^2 / (1 - rho) x replicas + backlog waiting (M/M/1). Finished prefills (requests with their
  prompt and output totals, in proportion) move to the decode queue.
- Decode: queued requests are admitted while KV has room (and <= 256 sequences per replica); a
  sequence holds its prompt + half its output in KV (the running set's mean context); step =
  step(batch per replica); ITL = step; a sequence lives (running mean output length) steps, drained
  exponentially. Requests that wait for a decode slot see one gap of at least a tick (ITL miss).
- A request meets the SLO when its TTFT <= slo_ttft and its decode ITL <= slo_itl; TTFT misses (per
  arrival tick) and ITL misses (per decode admission) are counted separately and combined as
  independent: attainment = (1 - TTFT miss rate) x (1 - ITL miss rate).
- Controllers decide on their own period (the first decision after one metrics window), at their
  scheduled instant, from the gauges of the current tick; new pods are ready `pod_start_s` later.

Invariants: no request is created or lost (arrivals = backlog + decode queue + running + finished);
GPU-seconds count every scheduled pod, loading or ready, each tick.
"""

from __future__ import annotations

import math
from collections import deque

from autoscale_fleet import MAX_BATCH, Controller, Params, Perf, Pool, PoolView, actuate
from autoscale_traces import Trace


def simulate(
    controller: Controller,
    trace: Trace,
    perf: Perf,
    params: Params,
    initial: dict[str, int],
    record_series: bool = False,
) -> dict:
    dt = trace.dt
    pools = {
        "prefill": Pool(initial["prefill"], initial["prefill"]),
        "decode": Pool(initial["decode"], initial["decode"]),
    }
    pre, dec = pools["prefill"], pools["decode"]
    arrivals, prompts, outputs = trace.arrivals.tolist(), trace.prompt_tokens.tolist(), trace.output_tokens.tolist()
    rates = trace.rate.tolist()
    tps, kv, step0, per_seq = perf.prefill_tps, perf.kv_tokens, perf.step0_s, perf.step_per_seq_s
    slo_ttft, slo_itl, window_s, pod_start = params.slo_ttft, params.slo_itl, params.window_s, params.pod_start_s
    bl = bl_p = bl_o = 0.0  # prefill backlog: requests, their prompt and output tokens
    dw = dw_p = dw_o = 0.0  # decode queue
    run = run_p = run_o = 0.0  # decoding
    mean_p = float(sum(prompts) / max(sum(arrivals), 1e-12))
    ttft_win: deque[tuple[float, float, float]] = deque()
    itl_win: deque[tuple[float, float, float]] = deque()
    pre_first: deque[tuple[float, float]] = deque()
    dec_first: deque[tuple[float, float]] = deque()
    pre_tokens: deque[tuple[float, float]] = deque()  # prompt tokens prefilled per tick
    gen_tokens: deque[tuple[float, float]] = deque()  # tokens generated per tick
    requests = ttft_bad = itl_bad = gpu_s = 0.0
    events = 0
    interval = controller.interval_s
    next_decision = window_s if interval > 0 else math.inf
    series: dict[str, list[float]] = {k: [] for k in ("t", "rate", "prefill", "decode", "ttft", "itl")}
    every = max(round(60 / dt), 1)
    for i in range(len(arrivals)):
        now = i * dt
        for pool in (pre, dec):  # pods finishing their start become ready
            while pool.loading and pool.loading[0][0] <= now:
                count = int(pool.loading.popleft()[1])
                pool.ready += count
                pool.n_loading -= count
        n, p_tok, o_tok = arrivals[i], prompts[i], outputs[i]
        if n > 0:
            mean_p = p_tok / n
        # Prefill pool.
        rp = pre.ready
        cap = rp * tps
        bl += n
        bl_p += p_tok
        bl_o += o_tok
        if cap > 0:
            rho = min(p_tok / dt / cap, 0.95)
            wait = bl_p / cap - mean_p / tps
            ttft = mean_p / tps * 1.5 / (1 - rho) + max(wait - dt, 0.0)
            done = min(bl_p, cap * dt)
            share = done / bl_p if bl_p > 0 else 0.0
            handed, handed_p, handed_o = bl * share, done, bl_o * share
            bl -= handed
            bl_p -= done
            bl_o -= handed_o
        else:
            rho = 0.95
            ttft = mean_p / tps * 1.5 / (1 - rho) + max(pod_start - dt, 0.0)
            handed = handed_p = handed_o = 0.0
        # Decode pool.
        rd = dec.ready
        waited = dw  # handed off before this tick: admitting them now means a gap >= dt
        dw += handed
        dw_p += handed_p
        dw_o += handed_o
        admit = 0.0
        if rd > 0 and dw > 0:
            room = min((rd * kv - run_p - run_o * 0.5) / ((dw_p + dw_o * 0.5) / dw), rd * MAX_BATCH - run)
            admit = min(dw, room) if room > 0 else 0.0
            if admit > 0:
                share = admit / dw
                run += admit
                run_p += dw_p * share
                run_o += dw_o * share
                dw -= admit
                dw_p -= dw_p * share
                dw_o -= dw_o * share
        occupied, kv_used = run, run_p + run_o * 0.5  # what the engine gauges show during the tick
        if rd > 0:
            step = step0 + per_seq * run / rd
            finished = 0.0
            if run > 0:
                # Exponential drain: a sequence lives its output length in steps; short lives must not empty the pool.
                finished = run * (1 - math.exp(-dt / (step * max(run_o / run, 1.0))))
                share = finished / run
                run_p -= run_p * share
                run_o -= run_o * share
                run -= finished
            tokens = (occupied - finished / 2) * dt / step
        else:
            step, tokens = math.inf, 0.0
        requests += n
        if ttft > slo_ttft:
            ttft_bad += n
        itl_bad += admit if step > slo_itl else min(admit, waited)
        gpu_s += (pre.scheduled + dec.scheduled) * dt
        cut = now - window_s
        for win in (ttft_win, itl_win, pre_first, dec_first, pre_tokens, gen_tokens):
            while win and win[0][0] <= cut:
                win.popleft()
        if n > 0:
            ttft_win.append((now, ttft, n))
        if tokens > 0:
            itl_win.append((now, step, tokens))
        if dw > 0:
            itl_win.append((now, dt, dw))
        pre_first.append((now, handed))
        dec_first.append((now, admit))
        pre_tokens.append((now, handed_p))
        gen_tokens.append((now, tokens))

        if now >= next_decision:
            views = {
                "prefill": PoolView(
                    pre.desired,
                    rp,
                    pre.n_loading,
                    pre.unschedulable,
                    running=rp * rho,
                    waiting=bl + rp * rho * rho / (1 - rho),
                    kv_usage=rho * mean_p / kv if rp else None,
                    first_tokens=sum(x for _, x in pre_first),
                    window_s=window_s,
                    latency=ttft_win,
                    prompt_tokens=sum(x for _, x in pre_tokens),
                ),
                "decode": PoolView(
                    dec.desired,
                    rd,
                    dec.n_loading,
                    dec.unschedulable,
                    running=occupied,
                    waiting=dw,
                    kv_usage=min(kv_used / (rd * kv), 1.0) if rd else None,
                    first_tokens=sum(x for _, x in dec_first),
                    window_s=window_s,
                    latency=itl_win,
                    generation_tokens=sum(x for _, x in gen_tokens),
                ),
            }
            current = {"prefill": pre.desired, "decode": dec.desired}
            target = controller.decide(next_decision, views)
            while next_decision <= now:
                next_decision += interval
            if target != current:
                events += 1
            actuate(pools, target, now, params)
        if record_series and i % every == 0:
            series["t"].append(now / 3600)
            series["rate"].append(rates[i])
            series["prefill"].append(pre.scheduled)
            series["decode"].append(dec.scheduled)
            series["ttft"].append(ttft)
            series["itl"].append(step if rd else 0.0)
    total = max(requests, 1e-12)
    result = {
        "policy": controller.name,
        # TTFT and ITL misses treated as independent (a request meets the SLO when it meets both).
        "slo_attainment": (1 - ttft_bad / total) * (1 - itl_bad / total),
        "ttft_attainment": 1 - ttft_bad / total,
        "itl_attainment": 1 - itl_bad / total,
        "gpu_hours": gpu_s / 3600,
        "scale_events": events,
    }
    if record_series:
        result["series"] = series
    return result
