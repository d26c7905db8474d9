-- recipes/presets/glm4_7_flash.lua: GLM-4.7-Flash (zai-org/GLM-4.7-Flash, a GLM-4.x MoE) with
-- GRPO on GSM8K as SkyRL's Megatron GLM-4.7 script (run_megatron_grpo_glm4_7_30b.sh, named in the
-- shared seeds) runs it: 8 GPUs, TP and EP over the node, R3 on, SkyRL's GSM8K defaults (5 samples
-- per prompt, 512-token prompts, 1024-token answers, KL 0.001 k3, lr 1e-6; shared
-- rl-algorithms.md 3.4). A GPU job: written down, refused on one process.
return {
    common = {model = {path = '${LUNAR_MODELS}/GLM-4.7-Flash', hf_id = 'zai-org/GLM-4.7-Flash', dtype = 'bf16',
                       device = 'cuda'},
              tokenizer = '${LUNAR_MODELS}/GLM-4.7-Flash/tokenizer.json'},
    grpo = {
        hardware = {nodes = 1, gpus_per_node = 8, gpu = 'H100'},
        parallel = {tp = 2, pp = 1, cp = 1, ep = 8, etp = 1},
        data = {kind = 'prompt_answer', train = '${LUNAR_DATA}/gsm8k/train.jsonl', valid = '${LUNAR_DATA}/gsm8k/test.jsonl',
                prompt_field = 'question', answer_field = 'answer', template = 'glm5'},
        rl = {reward = 'gsm8k', n = 5, prompts = 256, mini_batches = 4, micro_batch = 4, kl_coef = 0.001,
              kl_estimator = 'k3', routing_replay = true, eval_limit = 1319},
        rollout = {max_prompt_len = 512, max_new_tokens = 1024, temperature = 1.0, enable_thinking = true},
        train = {steps = 20, eval_every = 5},
        optim = {lr = 1e-6, min_lr = 1e-6, warmup = 0, schedule = 'constant', weight_decay = 0.01},
        metrics = {peak_flops = 989e12},
    },
}
