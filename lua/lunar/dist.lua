-- lunar.dist (stub: single process until the collectives land)
local M = {}
function M.rank() return 0 end
function M.world_size() return 1 end
function M.local_rank() return 0 end
return M
