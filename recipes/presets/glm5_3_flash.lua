-- recipes/presets/glm5_3_flash.lua: GLM-5.3-Flash (about 313B parameters, 17B active; KDA linear
-- attention, DSA with the k-pool indexer, mHC residuals: shared docs/glm5_3-flash.md) with
-- SkyRL's GLM-5.3-Flash RL scripts (shared seeds, "GLM-5.3 / GLM-5.3-Flash"):
--   grpo  GSM8K, LoRA, 8 GPUs (1 x 8 B300)
--   dapo  DAPO-Math, LoRA, 16 GPUs (2 x 8 B300), 2k prompt / 8k response budget
-- Both with R3, 12 samples per prompt (the scripts' choice: TP is the only way to split the model
-- and 12 keeps the batches divisible), TP8 (KDA has no context-parallel path and mHC refuses
-- pipeline parallelism), the BF16 weights (the FP8 release's blockwise scales are dropped by
-- SkyRL's import). The full fine-tuning DAPO script (8 x 8 B200) is the dapo preset with
-- peft=false hardware.nodes=8 hardware.gpu=B200 optim.lr=1e-6.
-- lunar builds the architecture, its LoRA and its generation (docs/flash.md; preset=tiny_flash runs
-- both RL recipes on a CPU) but not yet its tensor parallel or CUDA kernels, and these are GPU
-- jobs: written down, refused on one process (recipes/common.lua check_runnable).
local lora = {r = 128, alpha = 128, dropout = 0, targets = {'all-linear'}}
local model = {path = '${LUNAR_MODELS}/GLM-5.3-Flash-BF16', hf_id = 'zai-org/GLM-5.3-Flash', dtype = 'bf16',
               device = 'cuda'}

return {
    common = {model = model, tokenizer = '${LUNAR_MODELS}/GLM-5.3-Flash-BF16/tokenizer.json'},
    grpo = {
        hardware = {nodes = 1, gpus_per_node = 8, gpu = 'B300'},
        parallel = {tp = 8, pp = 1, cp = 1, ep = 8, etp = 1},
        data = {kind = 'prompt_answer', train = '${LUNAR_DATA}/gsm8k/train.jsonl', valid = '${LUNAR_DATA}/gsm8k/test.jsonl',
                prompt_field = 'question', answer_field = 'answer', template = 'glm5'},
        peft = lora,
        rl = {reward = 'gsm8k', n = 12, prompts = 96, mini_batches = 4, micro_batch = 4, kl_coef = 0.001,
              routing_replay = true, eval_limit = 1319},
        rollout = {max_prompt_len = 512, max_new_tokens = 1024, temperature = 1.0, enable_thinking = true},
        train = {steps = 50, eval_every = 5},
        optim = {lr = 1e-5, min_lr = 1e-5, warmup = 0, schedule = 'constant', weight_decay = 0.01},
    },
    dapo = {
        hardware = {nodes = 2, gpus_per_node = 8, gpu = 'B300'},
        parallel = {tp = 8, pp = 1, cp = 1, ep = 16, etp = 1},
        data = {kind = 'prompt_answer', train = '${LUNAR_DATA}/dapo/dapo_math_17k.jsonl',
                valid = '${LUNAR_DATA}/aime/aime24_test.jsonl', prompt_field = 'problem', answer_field = 'answer',
                template = 'glm5'},
        peft = lora,
        rl = {reward = 'dapo', n = 12, prompts = 96, mini_batches = 6, micro_batch = 2, eps_low = 0.2, eps_high = 0.28,
              dual_clip = 10, loss_reduction = 'token-mean', dynamic_sampling = false, overlong_buffer = 4096,
              overlong_penalty = 1.0, overlong_filter = true, tis_cap = 2.0, routing_replay = true, eval_limit = 30},
        rollout = {max_prompt_len = 2048, max_new_tokens = 8192, temperature = 1.0, enable_thinking = true},
        train = {steps = 30, eval_every = 5},
        optim = {lr = 1e-5, min_lr = 1e-5, warmup = 10, schedule = 'constant', weight_decay = 0.1},
    },
}
