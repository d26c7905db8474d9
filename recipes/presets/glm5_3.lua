-- recipes/presets/glm5_3.lua: GLM-5.3 (zai-org/GLM-5.3; the GLM-5.2 architecture, new
-- post-training) with NeMo AutoModel's validated full-parameter SFT layout (shared seeds):
--   sft  256 GPUs (32 x 8 H100)  EP64 CP1, FSDP2-style data parallel, packed 4,096-token rows,
--        local batch 4, global batch 256, cuDNN DSA + FlashMLA sparse forward, f32 router,
--        activation checkpointing; 100 steps (their loss 1.33 -> 0.54; 41,664 tokens/s).
-- and SkyRL's GLM-5.3 RL scripts (shared seeds, "GLM-5.3 / GLM-5.3-Flash"):
--   grpo  GSM8K, LoRA, 64 GPUs (8 x 8 B200; SkyRL serves the rollouts in FP8, lunar generates
--        with the training weights in bf16), R3 on
--   dapo  DAPO-Math, LoRA, 32 GPUs (4 x 8 B300), 2k prompt / 8k response budget, R3 on; the
--        full fine-tuning script (8 x 8 B200, MXFP8 training, FP8 rollouts, R3) is this preset
--        with peft=false hardware.nodes=8 hardware.gpu=B200 optim.lr=1e-6
-- The seeds name the hardware, the budgets and R3; the batch sizes, clip, loss and overlong
-- settings are SkyRL's DAPO and GSM8K scripts' (shared rl-algorithms.md 2.8 and 3.4), the LoRA
-- rank SkyRL's LoRA DAPO script's (128 / 128).
-- Multi-node: written down, refused on one process (recipes/common.lua check_runnable).
local lora = {r = 128, alpha = 128, dropout = 0, targets = {'all-linear'}}

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
    grpo = {
        hardware = {nodes = 8, gpus_per_node = 8, gpu = 'B200'},
        parallel = {tp = 1, pp = 1, cp = 1, ep = 64, etp = 1},
        data = {kind = 'prompt_answer', train = '${LUNAR_DATA}/gsm8k/train.jsonl', valid = '${LUNAR_DATA}/gsm8k/test.jsonl',
                prompt_field = 'question', answer_field = 'answer', template = 'glm5'},
        peft = lora,
        rl = {reward = 'gsm8k', n = 5, prompts = 1024, mini_batches = 4, micro_batch = 4, kl_coef = 0.001,
              kl_estimator = 'k3', routing_replay = true, eval_limit = 1319},
        rollout = {max_prompt_len = 512, max_new_tokens = 1024, temperature = 1.0, enable_thinking = true},
        train = {steps = 20, eval_every = 5},
        optim = {lr = 1e-5, min_lr = 1e-5, warmup = 0, schedule = 'constant', weight_decay = 0.01},
        metrics = {peak_flops = 2250e12},
    },
    dapo = {
        hardware = {nodes = 4, gpus_per_node = 8, gpu = 'B300'},
        parallel = {tp = 1, pp = 1, cp = 1, ep = 32, etp = 1},
        data = {kind = 'prompt_answer', train = '${LUNAR_DATA}/dapo/dapo_math_17k.jsonl',
                valid = '${LUNAR_DATA}/aime/aime24_test.jsonl', prompt_field = 'problem', answer_field = 'answer',
                template = 'glm5'},
        peft = lora,
        rl = {reward = 'dapo', n = 16, prompts = 512, mini_batches = 16, micro_batch = 2, eps_low = 0.2,
              eps_high = 0.28, dual_clip = 10, loss_reduction = 'token-mean', kl_coef = 0, dynamic_sampling = false,
              overlong_buffer = 4096, overlong_penalty = 1.0, overlong_filter = true, tis_cap = 2.0,
              routing_replay = true, eval_limit = 30},
        rollout = {max_prompt_len = 2048, max_new_tokens = 8192, temperature = 1.0, enable_thinking = true},
        train = {steps = 20, eval_every = 5},
        optim = {lr = 1e-5, min_lr = 1e-5, warmup = 10, schedule = 'constant', weight_decay = 0.1},
        metrics = {peak_flops = 2250e12},
    },
}
