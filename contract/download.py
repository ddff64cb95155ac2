"""What the operator and `tidepool download` agree on (torch-free, httpx-free: the operator imports it).

Invariants: the environment carries the Secret's *name* only (for messages); its values arrive as
the Hub's own variables (HF_TOKEN, HF_ENDPOINT) through the pod's secretKeyRef env.
"""

from __future__ import annotations

SECRET_NAME_ENV = "TIDEPOOL_CREDENTIALS_SECRET"  # name of the Secret the credentials came from
TERMINATION_LOG_ENV = "TIDEPOOL_TERMINATION_LOG"  # overrides the termination message path (tests)
TERMINATION_LOG = "/dev/termination-log"  # the kubelet's default terminationMessagePath
HF_ENDPOINT = "https://huggingface.co"  # the Hub when HF_ENDPOINT is unset (the download step and the operator)
HF_DEFAULT_REVISION = "main"  # the revision of an hf:// model when spec.model.revision is unset
