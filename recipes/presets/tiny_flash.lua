-- recipes/presets/tiny_flash.lua: a tiny GLM-5.3-Flash-architecture model (glm5_next:
-- Glm5NextForConditionalGeneration's text tower: KDA linear attention on three of four layers, a
-- NoPE MLA layer whose k-pool DSA indexer really drops pools at seq 512, mHC residuals over 4
-- streams, a dense first layer, MoE layers with group-limited routing, a shared expert and the
-- SwiGLU clamp) that trains on one CPU, with the tiny preset's tokenizer and the shipped data.
--   lunar recipes/sft.lua preset=tiny_flash
--   lunar recipes/lora.lua preset=tiny_flash      (adapters in PEFT's layout for transformers' model)
--   lunar recipes/pretrain.lua preset=tiny_flash
--   lunar recipes/gsm8k.lua preset=tiny_flash     (GRPO, 12 samples per prompt, R3: SkyRL's Flash settings)
--   lunar recipes/dapo.lua preset=tiny_flash
-- Its config is the nested form transformers writes (text_config + a tiny vision_config, whose
-- tower lunar never builds), so an exported model loads in transformers as
-- Glm5NextForConditionalGeneration.
local text = {
    vocab_size = 6400, hidden_size = 128, intermediate_size = 384, moe_intermediate_size = 96,
    num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 4,
    layer_types = {'linear_attention', 'linear_attention', 'linear_attention', 'indexed_attention'},
    mlp_layer_types = {'dense', 'sparse', 'sparse', 'sparse'},
    q_lora_rank = 64, kv_lora_rank = 32, qk_nope_head_dim = 32, qk_rope_head_dim = 0, v_head_dim = 32,
    n_routed_experts = 8, num_experts_per_tok = 2, n_shared_experts = 1, n_group = 2, topk_group = 1,
    routed_scaling_factor = 2.5, norm_topk_prob = true, swiglu_limit = 10.0,
    index_topk = 256, index_head_dim = 32, index_n_heads = 4, index_kpool = 4, index_kpool_always_select_tail = true,
    linear_num_heads = 4, linear_head_dim = 32, linear_conv_kernel_dim = 4, linear_lower_bound = -5.0,
    hc_mult = 4, hc_eps = 1e-6, hc_sinkhorn_iters = 20,
    hidden_act = 'silu', rms_norm_eps = 1e-5, initializer_range = 0.02,
    max_position_embeddings = 4096, pad_token_id = 6256, bos_token_id = 6258, eos_token_id = 6256,
}
local config = {
    architectures = {'Glm5NextForConditionalGeneration'}, model_type = 'glm5_next', tie_word_embeddings = false,
    text_config = text,
    vision_config = {depth = 1, hidden_size = 16, intermediate_size = 16, num_heads = 2, out_hidden_size = 128,
                     projection_intermediate_size = 16, patch_size = 2, image_size = 4, spatial_merge_size = 1},
}

local tokenizer = 'recipes/presets/tiny/tokenizer.json'

return {
    common = {
        model = {config = config, seed = 1234},
        tokenizer = tokenizer,
        hardware = {nodes = 1, gpus_per_node = 0, gpu = 'cpu'},
    },
    sft = {
        data = {kind = 'chat', train = {'examples/data/sft/gsm8k_train_chat_first1000.jsonl',
                                        'examples/data/sft/oasst_en100_conversations.jsonl'},
                template = 'glm5', seq_len = 512, micro_batch = 4, overlong = 'truncate'},
        train = {steps = 600, log_every = 10},
        optim = {lr = 2.5e-3, min_lr = 2e-4, warmup = 40, weight_decay = 0.1},
        checkpoint = {every = 200, keep_last = 2},
        expect_loss_fall = 0.5,
    },
    lora = {
        data = {kind = 'chat', train = {'examples/data/sft/gsm8k_train_chat_first1000.jsonl'}, template = 'glm5',
                seq_len = 512, micro_batch = 4, overlong = 'truncate'},
        train = {steps = 100, log_every = 10},
        optim = {lr = 5e-3, min_lr = 5e-4, warmup = 10, weight_decay = 0},
        -- every linear map: KDA's projections, the NoPE MLA's, the MLPs and every routed expert
        peft = {r = 8, alpha = 16, dropout = 0, seed = 7, targets = {'all-linear'}},
        checkpoint = {every = 50, keep_last = 2},
    },
    pretrain = {
        data = {kind = 'text', train = 'examples/data/pretrain/tinyshakespeare.txt', split = 'blank',
                seq_len = 512, micro_batch = 4},
        train = {steps = 200, log_every = 10},
        optim = {lr = 4e-3, min_lr = 4e-4, warmup = 20},
        checkpoint = {every = 100, keep_last = 2},
    },
    -- RL on the shipped GSM8K and DAPO-Math problems, three steps from the seeded init (the
    -- pipeline end to end: the model answers nothing right), with the GLM-5.3-Flash scripts'
    -- 12 samples per prompt and routing replay (R3)
    grpo = {
        data = {kind = 'prompt_answer', train = 'examples/data/rl/gsm8k_train.jsonl',
                valid = 'examples/data/eval/gsm8k_test.jsonl', prompt_field = 'question', answer_field = 'answer',
                template = 'glm5'},
        rl = {reward = 'gsm8k', n = 12, prompts = 2, mini_batches = 2, micro_batch = 6, eval_limit = 8,
              kl_coef = 0.001, kl_estimator = 'k3', routing_replay = true},
        rollout = {max_prompt_len = 512, max_new_tokens = 48, temperature = 1.0},
        train = {steps = 3, log_every = 1},
        optim = {lr = 1e-4, min_lr = 1e-4, warmup = 0, schedule = 'constant', weight_decay = 0.01},
        checkpoint = {every = 3, keep_last = 1},
    },
    dapo = {
        data = {kind = 'prompt_answer', train = 'examples/data/rl/dapo_math_17k_first2000.jsonl',
                prompt_field = 'problem', answer_field = 'answer', template = 'glm5'},
        rl = {reward = 'dapo', n = 12, prompts = 2, mini_batches = 1, micro_batch = 6, eps_low = 0.2, eps_high = 0.28,
              dual_clip = 10, loss_reduction = 'token-mean', dynamic_sampling = true, max_gen_batches = 2,
              overlong_buffer = 16, overlong_penalty = 1.0, routing_replay = true},
        rollout = {max_prompt_len = 1024, max_new_tokens = 48, temperature = 1.0},
        train = {steps = 3, log_every = 1},
        optim = {lr = 1e-4, min_lr = 1e-4, warmup = 0, schedule = 'constant', weight_decay = 0.1},
        checkpoint = {every = 3, keep_last = 1},
    },
}
