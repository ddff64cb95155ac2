"""Tidepool's Kubernetes operator (kopf handlers, pure builders, autoscaler, CRD generation).

Never imports the engine's torch code: the operator image has no torch.
"""
