-- recipes/presets/tiny.lua: a tiny GLM-5-architecture model (GlmMoeDsaForCausalLM: MLA, a DSA
-- indexer that really drops keys at seq 512, IndexShare, a dense first layer, MoE layers with
-- group-limited routing and a shared expert, an MTP layer carried along) that trains on one CPU
-- in minutes, with a byte-level BPE tokenizer in GLM's format (GLM's pre-tokenizer regex and
-- GLM-5's special tokens, 6,256 merges-based tokens + 36 added) and the shipped data. Its
-- tokenizer_config.json carries GLM-4.7/GLM-5's chat template (../shared/data/tokenizer/), so a
-- model exported from a run loads in transformers with AutoTokenizer and apply_chat_template
-- (checked: the same text as lunar.chat.render).
local config = {
    architectures = {'GlmMoeDsaForCausalLM'}, model_type = 'glm_moe_dsa',
    vocab_size = 6400,                 -- 6,292 tokens, padded like GLM-5's 154,880
    hidden_size = 128, intermediate_size = 384, moe_intermediate_size = 96,
    num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 4,
    q_lora_rank = 64, kv_lora_rank = 32, qk_nope_head_dim = 32, qk_rope_head_dim = 16, v_head_dim = 32,
    n_routed_experts = 8, num_experts_per_tok = 2, n_shared_experts = 1, n_group = 2, topk_group = 1,
    routed_scaling_factor = 2.5, norm_topk_prob = true,
    mlp_layer_types = {'dense', 'sparse', 'sparse', 'sparse'},
    index_topk = 256, index_head_dim = 32, index_n_heads = 4,
    indexer_types = {'full', 'shared', 'full', 'shared'},
    num_nextn_predict_layers = 1,
    hidden_act = 'silu', rms_norm_eps = 1e-5, initializer_range = 0.02, tie_word_embeddings = false,
    rope_parameters = {rope_type = 'default', rope_theta = 10000},
    max_position_embeddings = 4096, pad_token_id = 6256, bos_token_id = 6258, eos_token_id = 6256,
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
        expect_loss_fall = 0.5,      -- the main job fails unless the loss halves (it reaches ~54%)
    },
    pretrain = {
        data = {kind = 'text', train = 'examples/data/pretrain/tinyshakespeare.txt', split = 'blank',
                seq_len = 512, micro_batch = 4},
        train = {steps = 200, log_every = 10},
        optim = {lr = 4e-3, min_lr = 4e-4, warmup = 20},
        checkpoint = {every = 100, keep_last = 2},
    },
    -- RL on the shipped GSM8K and DAPO-Math problems: three steps of the tiny model from its
    -- seeded init (it answers nothing right: the run shows the pipeline end to end; the preset
    -- tiny_arith shows learning)
    grpo = {
        data = {kind = 'prompt_answer', train = 'examples/data/rl/gsm8k_train.jsonl',
                valid = 'examples/data/eval/gsm8k_test.jsonl', prompt_field = 'question', answer_field = 'answer',
                template = 'glm5'},
        rl = {reward = 'gsm8k', n = 4, prompts = 4, mini_batches = 2, micro_batch = 8, eval_limit = 8,
              kl_coef = 0.001, kl_estimator = 'k3'},
        rollout = {max_prompt_len = 512, max_new_tokens = 48, temperature = 1.0},
        train = {steps = 3, log_every = 1},
        optim = {lr = 1e-4, min_lr = 1e-4, warmup = 0, schedule = 'constant', weight_decay = 0.01},
        checkpoint = {every = 3, keep_last = 1},
    },
    dapo = {
        data = {kind = 'prompt_answer', train = 'examples/data/rl/dapo_math_17k_first2000.jsonl',
                prompt_field = 'problem', answer_field = 'answer', template = 'glm5'},
        rl = {reward = 'dapo', n = 4, prompts = 4, mini_batches = 1, micro_batch = 8, eps_low = 0.2, eps_high = 0.28,
              dual_clip = 10, loss_reduction = 'token-mean', dynamic_sampling = true, max_gen_batches = 2,
              overlong_buffer = 16, overlong_penalty = 1.0},
        rollout = {max_prompt_len = 1024, max_new_tokens = 48, temperature = 1.0},
        train = {steps = 3, log_every = 1},
        optim = {lr = 1e-4, min_lr = 1e-4, warmup = 0, schedule = 'constant', weight_decay = 0.1},
        checkpoint = {every = 3, keep_last = 1},
    },
    lora = {
        data = {kind = 'chat', train = {'examples/data/sft/gsm8k_train_chat_first1000.jsonl'}, template = 'glm5',
                seq_len = 512, micro_batch = 4, overlong = 'truncate'},
        train = {steps = 100, log_every = 10},
        optim = {lr = 5e-3, min_lr = 5e-4, warmup = 10, weight_decay = 0},
        peft = {r = 8, alpha = 16, dropout = 0, seed = 7,
                targets = {'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj',
                           'gate_proj', 'up_proj', 'down_proj'}},
        checkpoint = {every = 50, keep_last = 2},
    },
}
