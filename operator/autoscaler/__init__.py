"""Tidepool's autoscaler: a pure policy over per-pool metric windows, plus collection and actuation.

`policy.decide` and `window.PoolWindow` are pure (no client, no clock, no I/O) and shared with the
trace simulator `bench/autoscale_sim.py`; `collector` scrapes engine and router pods; `handlers`
registers the per-InferenceService kopf timer that collects, decides and (in active mode) scales.
"""
