"""`tidepool download`: fetch a Hugging Face model into a folder, once per cache, with a reason on failure.

Runs as the init container of engine pods for hf:// models (operator/builders/sources.py). Torch-free:
httpx and the standard library only.

Why our own client instead of huggingface_hub: the download step must resume, verify, lock a shared
cache, and turn every failure into one actionable line for the pod's termination message; with the
Hub's two HTTP calls (`GET /api/models/{repo}/revision/{rev}?blobs=true` for the file list with sizes
and LFS sha256, `GET /{repo}/resolve/{sha}/{file}` with a Range header) each of those is a few lines
we control, and tests stub the Hub with a plain HTTP server on 127.0.0.1. huggingface_hub's errors,
retries and cache layout (symlinked blobs) would have to be unwrapped for the same result.

Modules: `contract` (names the operator shares; imports nothing), `hub` (HTTP calls, error ->
message), `files` (resume, verify, lock, completion marker), `cli` (`main(argv)`, the termination
message). This package file imports none of them, so the operator can read `contract` without httpx.
"""
