-- lunar.model.params: the checkpoint tensors of GLM-5 (glm_moe_dsa) and GLM-4.x MoE (glm4_moe)
-- models, by name, with shapes, initialisation and trainability, derived from a validated config
-- (lunar.model.config). Names are HF's checkpoint names (per-expert experts, as published).
--
-- spec(cfg[, {mtp = false, experts = {first=, count=}, tp = {rank=, size=}, etp = {rank=, size=},
-- split_indexer = false}]) -> list of
-- {name=, shape=, init='normal'|'ones'|'zeros', trainable=bool, dtype=, mtp=bool}
-- The MTP layer (num_nextn_predict_layers > 0) is model.layers.<L>.*: a full decoder layer plus
-- eh_proj, enorm, hnorm and shared_head.norm; it is carried (loaded and saved) and only runs when
-- the model is asked for the MTP loss. {mtp = false} leaves it out: the model of a checkpoint
-- that declares the layer in its config but holds none of its tensors (transformers'
-- save_pretrained writes such checkpoints; see lunar.model.load). {experts = expert_range(...)}
-- lists the routed experts of that range only (what one expert-parallel rank holds). {tp = ...}
-- gives the tensor-parallel rank's blocks of the split tensors (entries with `split`): shape is the
-- block's, full_shape the checkpoint's, slice = {dim =, start =, len =, group = 'tp'} where the
-- block sits. {etp = ...} likewise cuts each routed expert's matrices over expert tensor parallel
-- (gate/up by rows, down by columns; entries with `esplit`, slice.group = 'etp').
local M = {}

-- split: the dim (1 or 2) tensor parallel splits it along (consecutive blocks in rank order), or nil
local function add(list, name, shape, init, trainable, dtype, split)
    list[#list + 1] = {name = name, shape = shape, init = init, trainable = trainable ~= false, dtype = dtype,
                       split = split}
end

-- The tensors of one decoder layer `i` (prefix model.layers.i.); mlp_type 'dense'|'sparse';
-- indexer true when the layer runs its own DSA indexer.
local function layer_specs(list, cfg, i, mlp_type, indexer, experts, split_indexer)
    local p = ('model.layers.%d.'):format(i)
    local H = cfg.hidden_size
    add(list, p .. 'input_layernorm.weight', {H}, 'ones')
    add(list, p .. 'post_attention_layernorm.weight', {H}, 'ones')
    local a = p .. 'self_attn.'
    if cfg.model_type == 'glm_moe_dsa' then
        local NH, Dn, Dr, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        local Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        add(list, a .. 'q_a_proj.weight', {Rq, H}, 'normal')
        if cfg.attention_bias then add(list, a .. 'q_a_proj.bias', {Rq}, 'zeros') end
        add(list, a .. 'q_a_layernorm.weight', {Rq}, 'ones')
        add(list, a .. 'q_b_proj.weight', {NH * (Dn + Dr), Rq}, 'normal', nil, nil, 1)
        add(list, a .. 'kv_a_proj_with_mqa.weight', {Rkv + Dr, H}, 'normal')
        if cfg.attention_bias then add(list, a .. 'kv_a_proj_with_mqa.bias', {Rkv + Dr}, 'zeros') end
        add(list, a .. 'kv_a_layernorm.weight', {Rkv}, 'ones')
        add(list, a .. 'kv_b_proj.weight', {NH * (Dn + Dv), Rkv}, 'normal', nil, nil, 1)
        add(list, a .. 'o_proj.weight', {H, NH * Dv}, 'normal', nil, nil, 2)
        if cfg.attention_bias then add(list, a .. 'o_proj.bias', {H}, 'zeros') end
        if indexer then
            -- trained only by the optional indexer loss: no gradient from the LM loss (HF no_grad)
            local Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            local x = a .. 'indexer.'
            -- (tensor parallel with split_indexer: the indexer's heads, wq_b and weights_proj by rows)
            local isplit = split_indexer and 1 or nil
            add(list, x .. 'wq_b.weight', {Hi * Di, Rq}, 'normal', nil, nil, isplit)
            add(list, x .. 'wk.weight', {Di, H}, 'normal')
            add(list, x .. 'k_norm.weight', {Di}, 'ones')
            add(list, x .. 'k_norm.bias', {Di}, 'zeros')
            add(list, x .. 'weights_proj.weight', {Hi, H}, 'normal', nil, nil, isplit)
        end
    else -- glm4_moe: GQA (tensor parallel: q/k/v by heads, column; o_proj by heads, row)
        local NH, NKV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        add(list, a .. 'q_proj.weight', {NH * hd, H}, 'normal', nil, nil, 1)
        add(list, a .. 'k_proj.weight', {NKV * hd, H}, 'normal', nil, nil, 1)
        add(list, a .. 'v_proj.weight', {NKV * hd, H}, 'normal', nil, nil, 1)
        if cfg.attention_bias then
            add(list, a .. 'q_proj.bias', {NH * hd}, 'zeros', nil, nil, 1)
            add(list, a .. 'k_proj.bias', {NKV * hd}, 'zeros', nil, nil, 1)
            add(list, a .. 'v_proj.bias', {NKV * hd}, 'zeros', nil, nil, 1)
        end
        add(list, a .. 'o_proj.weight', {H, NH * hd}, 'normal', nil, nil, 2)
        if cfg.use_qk_norm then
            add(list, a .. 'q_norm.weight', {hd}, 'ones')
            add(list, a .. 'k_norm.weight', {hd}, 'ones')
        end
    end
    local m = p .. 'mlp.'
    if mlp_type == 'dense' then
        local I = cfg.intermediate_size
        add(list, m .. 'gate_proj.weight', {I, H}, 'normal', nil, nil, 1)
        add(list, m .. 'up_proj.weight', {I, H}, 'normal', nil, nil, 1)
        add(list, m .. 'down_proj.weight', {H, I}, 'normal', nil, nil, 2)
    else
        local E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
        add(list, m .. 'gate.weight', {E, H}, 'normal', true, 'f32')
        add(list, m .. 'gate.e_score_correction_bias', {E}, 'zeros', false, 'f32')
        local first, count = 0, E
        if experts then first, count = experts.first, experts.count end
        for e = first, first + count - 1 do
            local x = ('%sexperts.%d.'):format(m, e)
            add(list, x .. 'gate_proj.weight', {Im, H}, 'normal'); list[#list].esplit = 1
            add(list, x .. 'up_proj.weight', {Im, H}, 'normal'); list[#list].esplit = 1
            add(list, x .. 'down_proj.weight', {H, Im}, 'normal'); list[#list].esplit = 2
        end
        local Is = Im * cfg.n_shared_experts
        if Is > 0 then
            add(list, m .. 'shared_experts.gate_proj.weight', {Is, H}, 'normal', nil, nil, 1)
            add(list, m .. 'shared_experts.up_proj.weight', {Is, H}, 'normal', nil, nil, 1)
            add(list, m .. 'shared_experts.down_proj.weight', {H, Is}, 'normal', nil, nil, 2)
        end
    end
end

-- Does decoder layer i run its own indexer? (glm_moe_dsa only; 'shared' layers reuse indices)
function M.has_indexer(cfg, i)
    if cfg.model_type ~= 'glm_moe_dsa' then return false end
    return cfg.indexer_types[i + 1] == 'full'
end

function M.mlp_type(cfg, i)
    return cfg.mlp_layer_types[i + 1]
end

-- the number of MTP layers a model of cfg carries: num_nextn_predict_layers, or 0 with
-- opts.mtp == false
function M.mtp_layers(cfg, opts)
    if opts and opts.mtp == false then return 0 end
    return cfg.num_nextn_predict_layers or 0
end

-- The routed experts member `rank` of an expert-parallel group of `size` holds: {first=, count=}
-- (0-based first expert id), consecutive blocks of n_routed_experts / size in rank order.
function M.expert_range(cfg, rank, size)
    local E = cfg.n_routed_experts or 0
    if E % size ~= 0 then
        error(('n_routed_experts %d is not divisible by the expert-parallel size ep = %d'):format(E, size), 2)
    end
    local count = E / size
    return {first = rank * count, count = count}
end

-- tensor parallel of `tp` ranks splits the vocabulary when it divides vocab_size
-- (lunar.parallel.vocab); otherwise the embedding and the LM head stay whole on every rank
function M.vocab_split(cfg, tp)
    return require('lunar.parallel.vocab').splits(cfg, tp)
end

function M.spec(cfg, opts)
    local list = {}
    local H, V = cfg.hidden_size, cfg.vocab_size
    -- the vocabulary splits over tp (embedding and LM head by rows) when tp divides it
    local vsplit = opts and opts.tp and M.vocab_split(cfg, opts.tp.size) and 1 or nil
    add(list, 'model.embed_tokens.weight', {V, H}, 'normal', nil, nil, vsplit)
    for i = 0, cfg.num_hidden_layers - 1 do
        layer_specs(list, cfg, i, M.mlp_type(cfg, i), M.has_indexer(cfg, i), opts and opts.experts,
            opts and opts.split_indexer)
    end
    add(list, 'model.norm.weight', {H}, 'ones')
    if not cfg.tie_word_embeddings then add(list, 'lm_head.weight', {V, H}, 'normal', nil, nil, vsplit) end
    -- MTP layers follow the main layers (DeepSeek-V3 / GLM layout): a MoE decoder layer with a
    -- full indexer, plus the projections that feed it.
    local main = #list
    for d = 0, M.mtp_layers(cfg, opts) - 1 do
        local i = cfg.num_hidden_layers + d
        local p = ('model.layers.%d.'):format(i)
        add(list, p .. 'enorm.weight', {H}, 'ones')
        add(list, p .. 'hnorm.weight', {H}, 'ones')
        add(list, p .. 'eh_proj.weight', {H, 2 * H}, 'normal')
        add(list, p .. 'shared_head.norm.weight', {H}, 'ones')
        layer_specs(list, cfg, i, 'sparse', cfg.model_type == 'glm_moe_dsa', opts and opts.experts,
            opts and opts.split_indexer)
    end
    for k = main + 1, #list do list[k].mtp = true end
    return M.cut(list, opts)
end

-- cut(list, opts) -> list: this rank's block of each split tensor of a spec (entries with `split`
-- for opts.tp, `esplit` for opts.etp: the dim cut in consecutive blocks in rank order): shape cut,
-- full_shape the whole one, slice = {dim =, start = 0-based, len =, full =, group = 'tp'|'etp'}.
-- Shared by every model family's spec.
function M.cut(list, opts)
    for _, cut in ipairs({{axis = 'tp', key = 'split', what = 'tensor-parallel'},
                          {axis = 'etp', key = 'esplit', what = 'expert tensor-parallel'}}) do
        local g = opts and opts[cut.axis]   -- (given when the axis splits: lunar.parallel.context)
        if g then
            for _, s in ipairs(list) do
                local dim = s[cut.key]
                if dim then
                    local full = s.shape[dim]
                    if full % g.size ~= 0 then
                        error(('%s: dim %d of size %d is not divisible by the %s size %s = %d'):format(s.name,
                            dim, full, cut.what, cut.axis, g.size), 3)
                    end
                    local len = full / g.size
                    local whole = s.shape
                    s.full_shape, s.shape = {}, {}
                    for k, n in ipairs(whole) do s.full_shape[k], s.shape[k] = n, n end
                    s.shape[dim] = len
                    s.slice = {dim = dim, start = g.rank * len, len = len, full = full, group = cut.axis}
                end
            end
        end
    end
    return list
end

-- Fused expert tensors (HF v5 in-memory layout, which some writers save) -> per-expert names.
-- Returns the per-expert table entries to add and the fused names consumed, or nil.
--   mlp.experts.gate_up_proj [E, 2Im, H] = [gate_e; up_e] per expert, mlp.experts.down_proj [E, H, Im]
function M.split_fused_experts(name, t)
    local prefix, which = name:match('^(.*%.mlp%.experts)%.(gate_up_proj)$')
    if not prefix then prefix, which = name:match('^(.*%.mlp%.experts)%.(down_proj)$') end
    if not prefix then return nil end
    local out = {}
    local E = t:size(1)
    for e = 0, E - 1 do
        local te = t:select(1, e + 1)
        if which == 'gate_up_proj' then
            local im = te:size(1) / 2
            out[('%s.%d.gate_proj.weight'):format(prefix, e)] = te:narrow(1, 1, im)
            out[('%s.%d.up_proj.weight'):format(prefix, e)] = te:narrow(1, im + 1, im)
        else
            out[('%s.%d.down_proj.weight'):format(prefix, e)] = te
        end
    end
    return out
end

-- split_all_fused(tensors) -> fused: every fused expert tensor of a checkpoint's {name = tensor}
-- replaced in place by its per-expert entries; fused maps each consumed name to its dtype (the
-- export writes them back in that layout)
function M.split_all_fused(tensors)
    local fused, split = {}, {}
    for name, t in pairs(tensors) do
        local parts = M.split_fused_experts(name, t)
        if parts then
            fused[name] = t:dtype()
            for k, v in pairs(parts) do split[k] = v end
        end
    end
    for name in pairs(fused) do tensors[name] = nil end
    for k, v in pairs(split) do tensors[k] = v end
    return fused
end

return M
