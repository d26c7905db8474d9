-- lunar.model: GLM-5 / GLM-4.x models. For now: config (validated Hugging Face config.json).
local M = {}

M.config = require 'lunar.model.config'

return M
