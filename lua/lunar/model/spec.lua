-- lunar.model.spec: the checkpoint tensors of a model of any family, by name with shapes,
-- initialisation and trainability (GLM-5 and GLM-4.x: lunar.model.params; GLM-5.3-Flash:
-- lunar.model.glm5_next_params), for the code that walks a model's tensors without knowing its
-- family: the split checkpoints and exports, the gathered views of a split model, --dry-run's
-- counts.
--
--   local mspec = require 'lunar.model.spec'
--   for _, s in ipairs(mspec.of(cfg, opts)) do ... end    -- opts as the family's spec takes them
--                                                          -- (lunar.parallel.context:spec_opts)
local params = require 'lunar.model.params'
local fparams = require 'lunar.model.glm5_next_params'

local M = {}

function M.of(cfg, opts)
    if cfg.model_type == 'glm5_next' then return fparams.spec(cfg, opts) end
    return params.spec(cfg, opts)
end

return M
