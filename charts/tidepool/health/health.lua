-- Argo CD health check for tidepool.dev/InferenceService (Lua 5.1, as Argo CD runs it).
-- Install: argocd-cm key `resource.customizations.health.tidepool.dev_InferenceService` (see the README,
-- "GitOps: Flux and Argo CD"). Tested against status objects a control-plane test captures
-- (tests/controlplane/test_cp_gitops_health.py) and in tests/operator/test_kstatus.py.
--
-- It reads the conditions the operator writes (operator/status.py), in this order:
--   no status yet, or status.observedGeneration behind metadata.generation  -> Progressing
--   Stalled=True     (invalid spec, refused apply, failed download, crash loop)  -> Degraded
--   Progressing reason Paused (annotation tidepool.dev/paused: "true")          -> Suspended
--   Reconciling=True (this generation does not serve yet, or still rolls out) -> Progressing
--   Degraded=True    (serving, but e.g. a declared LoRA adapter failed, a replica crash-loops) -> Degraded
--   Ready=True                                                                 -> Healthy
--   anything else                                                              -> Progressing
-- so Healthy means what kstatus' Current means (Flux `wait`): the current generation serves.
local hs = { status = "Progressing", message = "Waiting for the operator to report status" }
if obj.status == nil then
  return hs
end

local generation = obj.metadata and obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed ~= generation) then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = {}
if obj.status.conditions ~= nil then
  for _, condition in ipairs(obj.status.conditions) do
    conditions[condition.type] = condition
  end
end

local function is_true(type_)
  return conditions[type_] ~= nil and conditions[type_].status == "True"
end

local function describe(type_)
  local condition = conditions[type_]
  local reason = condition.reason or ""
  local message = condition.message or ""
  if reason ~= "" and message ~= "" then
    return reason .. ": " .. message
  end
  return reason .. message
end

if is_true("Stalled") then
  hs.status = "Degraded"
  hs.message = describe("Stalled")
  return hs
end
if conditions["Progressing"] ~= nil and conditions["Progressing"].reason == "Paused" then
  hs.status = "Suspended"  -- as Argo CD shows a paused Deployment
  hs.message = describe("Progressing")
  return hs
end
if is_true("Reconciling") then
  hs.status = "Progressing"
  hs.message = describe("Reconciling")
  return hs
end
if is_true("Degraded") then
  hs.status = "Degraded"
  hs.message = describe("Degraded")
  return hs
end
if is_true("Ready") then
  hs.status = "Healthy"
  hs.message = describe("Ready")
  return hs
end
if conditions["Ready"] ~= nil then
  hs.message = describe("Ready")
else
  hs.message = "Waiting for the Ready condition"
end
return hs
