-- lunar.parallel.state: the parallel layout of a run in one place: the recipe's parallel settings
-- checked against the world and the model, the layout's process groups, and what the model is
-- built with (Megatron core's parallel_state).
--
--   local state = require 'lunar.parallel.state'
--   state.check(cfg, world_size)       -- the recipe's parallel settings: refused with one line
--                                      -- naming the setting and the numbers, before any work
--   state.check_model(cfg, mcfg, ps)   -- the model config against the layout (experts, widths)
--   local ps = state.new(cfg.parallel) -- the groups (collective: every rank, the same settings)
--   ps.layout                          -- lunar.dist's layout (docs/parallel.md: the rank order)
--   ps.dp, ps.tp, ps.ep, ps.edp, ps.etp   -- groups; tp, ep / edp and etp only when they split
--   ps.sizes                           -- {tp =, pp =, cp =, dp =, ep =, etp =, edp =, vpp =}
--   ps:model_opts()                    -- {tp =, ep =, etp =, sequence_parallel =, split_indexer =}
--                                      -- for lunar.model.new / load (lunar.parallel.context)
local lunar = require 'lunar'
local core = require 'lunar.core'
local dist = require 'lunar.dist'

local user_error = core.user_error

local M = {}

local State = {}
State.__index = State

-- the refusals of a recipe's parallel settings (cfg.parallel, cfg.hardware, cfg.peft, cfg.kind,
-- cfg.data) on a world of world_size ranks
function M.check(cfg, world_size)
    local h, p = cfg.hardware, cfg.parallel
    local rl = cfg.kind == 'grpo' or cfg.kind == 'dapo'
    local n = math.max(1, h.nodes * math.max(h.gpus_per_node, 1))
    if n > 1 and n ~= world_size then
        user_error(('recipe %s describes a %d-GPU job (%d node%s x %d %s; TP%d PP%d CP%d EP%d) but runs as %d rank%s: '
            .. 'pipeline and context parallel training are not implemented in this version of lunar '
            .. '(data, tensor and expert parallel are); the tiny preset runs on one CPU process, or data, tensor and '
            .. 'expert parallel under mpirun'):format(
            cfg.name, n, h.nodes, h.nodes == 1 and '' or 's', h.gpus_per_node, h.gpu, p.tp, p.pp, p.cp, p.ep,
            world_size, world_size == 1 and '' or 's'))
    end
    for _, k in ipairs({'tp', 'pp', 'cp', 'ep', 'etp', 'vpp'}) do
        local v = p[k]
        if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
            user_error(('recipe %s: parallel.%s=%s: expected a positive integer'):format(cfg.name, k, tostring(v)))
        end
    end
    local missing
    for _, k in ipairs({'pp', 'cp', 'vpp'}) do
        if p[k] ~= 1 and not missing then
            missing = ('parallel.%s=%s: this parallel degree is not implemented in this version of lunar (data, tensor '
                .. 'and expert parallel are: mpirun -np N with parallel.tp and parallel.ep * parallel.etp dividing N and '
                .. 'parallel.pp, cp and vpp all 1); set parallel.%s=1'):format(k, tostring(p[k]), k)
        end
    end
    if not missing and p.tp > 1 and cfg.peft and (cfg.peft.dropout or 0) > 0 then
        -- a row-parallel module's adapter sees this rank's columns of the input: its dropout mask
        -- would not be the one-rank mask's block
        missing = ('parallel.tp=%d with peft.dropout=%s: LoRA dropout under tensor parallel is not implemented in this '
            .. 'version of lunar; set peft.dropout=0'):format(p.tp, tostring(cfg.peft.dropout))
    end
    local sp = p.sequence_parallel
    if not missing and sp ~= nil and sp ~= false and sp ~= true then
        missing = ('parallel.sequence_parallel=%s: expected true or false'):format(tostring(sp))
    end
    local si = p.split_indexer
    if not missing and si ~= nil and si ~= false and si ~= true then
        missing = ('parallel.split_indexer=%s: expected true or false'):format(tostring(si))
    end
    if not missing and si == true and p.tp == 1 then
        missing = 'parallel.split_indexer=true needs parallel.tp > 1 (it splits the indexer\'s heads between the tp ranks)'
    end
    if not missing and sp == true and p.tp == 1 then
        missing = 'parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the rows between the tp ranks)'
    end
    if not missing and sp == true and rl then
        -- RL's forwards run the LM head at the response positions only, which sequence parallel
        -- does not split
        missing = ('parallel.sequence_parallel=true with the %s recipe is not implemented in this version of lunar; '
            .. 'set parallel.sequence_parallel=false'):format(cfg.kind)
    end
    if not missing and sp == true and not rl and (cfg.data.micro_batch * cfg.data.seq_len) % p.tp ~= 0 then
        missing = ('parallel.sequence_parallel=true: the %d tokens of a micro-batch (data.micro_batch %d x data.seq_len '
            .. '%d) do not split evenly over parallel.tp=%d'):format(cfg.data.micro_batch * cfg.data.seq_len,
            cfg.data.micro_batch, cfg.data.seq_len, p.tp)
    end
    for _, k in ipairs({'etp', 'tp'}) do
        if not missing and p[k] > 1 and p.distributed_optimizer == false then
            missing = ('parallel.%s=%d with parallel.distributed_optimizer=false is not implemented in this version of '
                .. 'lunar (the replicated optimizer\'s state differs between the %s ranks and is written by one); leave '
                .. 'parallel.distributed_optimizer=true'):format(k, p[k], k)
        end
    end
    -- the layout first, so that a world the degrees do not divide is named with its numbers
    local ok, err = pcall(dist.plan, {tp = p.tp, pp = p.pp, cp = p.cp, ep = p.ep, etp = p.etp}, world_size)
    if not ok then
        user_error(('recipe %s: the parallel layout does not fit %d rank%s: %s%s'):format(cfg.name, world_size,
            world_size == 1 and '' or 's', lunar.config.strip_where(tostring(err)), missing and ('; and ' .. missing) or ''))
    end
    if missing then user_error(('recipe %s: %s'):format(cfg.name, missing)) end
    if type(p.bucket_mb) ~= 'number' or not (p.bucket_mb > 0) then
        user_error(('recipe %s: parallel.bucket_mb=%s: expected a positive number'):format(cfg.name, tostring(p.bucket_mb)))
    end
end

-- the model config mcfg against a split layout ps: expert parallel needs routed experts that the
-- ep ranks divide (and an expert width etp divides); what it does not do yet is refused, on every
-- rank, before any work
function M.check_model(cfg, mcfg, ps)
    if not ps.ep then return end
    local ep, E = ps.ep:size(), mcfg.n_routed_experts
    local etp = ps.etp and ps.etp:size() or 1
    local what = etp > 1 and ('parallel.etp=%d'):format(etp) or ('parallel.ep=%d'):format(ep)
    if not E or E < 1 then
        user_error(('%s: the model (%s) has no routed experts to spread; set parallel.ep=1 and parallel.etp=1'):format(what,
            tostring(mcfg.architecture)))
    end
    local Im = mcfg.moe_intermediate_size
    if etp > 1 and Im % etp ~= 0 then
        user_error(('parallel.etp=%d does not divide the experts\' width %d (moe_intermediate_size): choose an etp that '
            .. 'divides %d'):format(etp, Im, Im))
    end
    if etp > 1 and cfg.peft then
        user_error(('parallel.etp=%d with LoRA (peft): adapters on experts split by etp are not implemented in this '
            .. 'version of lunar; set parallel.etp=1'):format(etp))
    end
    if E % ep ~= 0 then
        user_error(('parallel.ep=%d does not divide the model\'s %d routed experts (n_routed_experts): choose an ep '
            .. 'that divides %d'):format(ep, E, E))
    end
    if cfg.peft and (cfg.peft.dropout or 0) > 0 then
        -- each rank runs its experts' adapters on other ranks' rows: the dropout draws would follow
        -- neither one rank's stream nor survive a resume
        user_error(('parallel.ep=%d with peft.dropout=%s: LoRA dropout under expert parallel is not implemented in this '
            .. 'version of lunar; set peft.dropout=0, or parallel.ep=1'):format(ep, tostring(cfg.peft.dropout)))
    end
end

-- new(p): the layout of the parallel settings p over the world (collective: every rank calls it
-- with the same p, lunar.dist.layout)
function M.new(p)
    p = p or {}
    local sizes = {tp = p.tp or 1, pp = p.pp or 1, cp = p.cp or 1, ep = p.ep or 1, etp = p.etp or 1, vpp = p.vpp or 1}
    local lay = dist.layout{tp = sizes.tp, pp = sizes.pp, cp = sizes.cp, ep = sizes.ep, etp = sizes.etp}
    sizes.dp, sizes.edp = lay.dp, lay.edp
    local self = setmetatable({layout = lay, sizes = sizes, dp = lay:group('dp')}, State)
    -- expert parallel: the experts spread over ep and/or each expert's matrices over etp (the ep
    -- group, of one rank when ep = 1, dispatches the tokens)
    if sizes.ep > 1 or sizes.etp > 1 then self.ep, self.edp = lay:group('ep'), lay:group('edp') end
    if sizes.etp > 1 then self.etp = lay:group('etp') end
    if sizes.tp > 1 then self.tp = lay:group('tp') end
    self.sequence_parallel = sizes.tp > 1 and p.sequence_parallel == true or nil
    self.split_indexer = sizes.tp > 1 and p.split_indexer == true or nil
    return self
end

function State:group(axis) return self.layout:group(axis) end

-- what lunar.model.new / load take of the layout
function State:model_opts()
    return {tp = self.tp, ep = self.ep, etp = self.etp, sequence_parallel = self.sequence_parallel,
            split_indexer = self.split_indexer}
end

return M
