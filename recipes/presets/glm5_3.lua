-- recipes/presets/glm5_3.lua: GLM-5.3 (zai-org/GLM-5.3; the GLM-5.2 architecture, new
-- post-training) with NeMo AutoModel's validated full-parameter SFT layout (shared seeds):
--   sft  256 GPUs (32 x 8 H100)  EP64 CP1, FSDP2-style data parallel, packed 4,096-token rows,
--        local batch 4, global batch 256, cuDNN DSA + FlashMLA sparse forward, f32 router,
--        activation checkpointing; 100 steps (their loss 1.33 -> 0.54; 41,664 tokens/s).
-- Multi-node: written down, refused on one process (recipes/common.lua check_runnable).
return {
    common = {model = {path = '${LUNAR_MODELS}/GLM-5.3', hf_id = 'zai-org/GLM-5.3', dtype = 'bf16', device = 'cuda'},
              tokenizer = '${LUNAR_MODELS}/GLM-5.3/tokenizer.json'},
    sft = {
        hardware = {nodes = 32, gpus_per_node = 8, gpu = 'H100'},
        parallel = {tp = 1, pp = 1, cp = 1, ep = 64, etp = 1},
        data = {kind = 'chat', train = '${LUNAR_DATA}/tulu3_sft.jsonl', template = 'glm5', seq_len = 4096,
                micro_batch = 4},
        train = {steps = 100, grad_accum = 1},                  -- GBS 256 = 64 ranks x LBS 4
        optim = {lr = 1e-5, min_lr = 0, warmup = 10, weight_decay = 0.01},
        metrics = {peak_flops = 989e12},
    },
}
