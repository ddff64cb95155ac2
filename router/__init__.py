"""The router (`tidepool router`): the data-plane entry of an InferenceService.

A light OpenAI-compatible proxy in front of engine replicas: discovery (`discovery`),
health and load scraping (`health`), pools with holding at zero (`pool`), pure routing
policies (`policy`, `prefix`, LoRA affinity in `lora`), forwarding with retries and the
prefill→decode hand-off protocol (`proxy`), its metrics (`metrics`, names in
`tidepool.contract.router_metrics_names`), the app (`app`) and the command line (`cli`). It
never loads a model and imports no torch; it imports nothing from the engine (only
`tidepool.contract` and `tidepool.common`).
"""
