-- recipes/presets/glm5_2.lua: GLM-5.2 (zai-org/GLM-5.2, GlmMoeDsaForCausalLM: 78 layers, hidden
-- 6144, 256 routed experts top-8 + 1 shared, MLA, DSA with IndexShare, MTP 1) with the layouts
-- that Megatron-Bridge's GLM-5.2 verification card validated (shared seeds: model verification).
-- These are multi-node GPU jobs: this version of lunar writes them down and refuses to run them
-- on one process (recipes/common.lua check_runnable); the tiny preset is the runnable one.
--   pretrain  352 H100 (44 x 8)  TP1 PP11 CP1 EP32 ETP1  GBS 1024 MBS 1  seq 2048, DeepEP
--   sft       416 H100 (52 x 8)  TP1 PP13 CP2 EP32 ETP1  GBS 32 MBS 1    seq 2048
--   lora      208 H100 (26 x 8)  TP1 PP13 CP1 EP16 ETP1  GBS 32 MBS 1    seq 2048
-- Every run: bf16, cuDNN DSA, sparse indexer loss coefficient 0.001, MTP 1.
local model = {path = '${LUNAR_MODELS}/GLM-5.2', hf_id = 'zai-org/GLM-5.2', dtype = 'bf16', device = 'cuda',
               indexer_loss_coeff = 0.001}

return {
    common = {model = model, tokenizer = '${LUNAR_MODELS}/GLM-5.2/tokenizer.json'},
    pretrain = {
        hardware = {nodes = 44, gpus_per_node = 8, gpu = 'H100'},
        parallel = {tp = 1, pp = 11, cp = 1, ep = 32, etp = 1},
        data = {kind = 'indexed', train = '${LUNAR_DATA}/pretrain_text_document', seq_len = 2048, micro_batch = 1},
        train = {steps = 100, grad_accum = 32},                 -- GBS 1024 = 32 DP x 32 accumulation x MBS 1
        optim = {lr = 1e-4, min_lr = 1e-5, warmup = 10, weight_decay = 0.1},
        metrics = {peak_flops = 989e12},
    },
    sft = {
        hardware = {nodes = 52, gpus_per_node = 8, gpu = 'H100'},
        parallel = {tp = 1, pp = 13, cp = 2, ep = 32, etp = 1},
        data = {kind = 'chat', train = '${LUNAR_DATA}/sft.jsonl', template = 'glm5', seq_len = 2048, micro_batch = 1},
        train = {steps = 100, grad_accum = 2},                  -- GBS 32 = 16 DP x 2 x MBS 1
        optim = {lr = 5e-6, min_lr = 0, warmup = 10, weight_decay = 0.1},
        metrics = {peak_flops = 989e12},
    },
    lora = {
        hardware = {nodes = 26, gpus_per_node = 8, gpu = 'H100'},
        parallel = {tp = 1, pp = 13, cp = 1, ep = 16, etp = 1},
        data = {kind = 'chat', train = '${LUNAR_DATA}/sft.jsonl', template = 'glm5', seq_len = 2048, micro_batch = 1},
        train = {steps = 100, grad_accum = 2},                  -- GBS 32 = 16 DP x 2 x MBS 1
        optim = {lr = 1e-4, min_lr = 0, warmup = 10, weight_decay = 0},
        peft = {r = 16, alpha = 32, dropout = 0,
                targets = {'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj'}},
        metrics = {peak_flops = 989e12},
    },
}
