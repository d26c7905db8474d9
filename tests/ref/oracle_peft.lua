-- oracle_peft.lua: train LoRA adapters on a fixture model for a few AdamW steps, then write the
-- PEFT adapter, lunar's logits with the adapters, and the merged HF export, for
-- tests/ref/check_peft.py (HF PEFT loads the adapter onto the transformers model; transformers
-- reloads the merged export strictly).
--
--   ./build/lunar tests/ref/oracle_peft.lua CASE OUTDIR
--   python3 tests/ref/check_peft.py OUTDIR
--
-- The adapters cover every linear map (all-linear): attention projections, dense MLPs, shared
-- experts and every routed expert's gate/up/down_proj.
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local peft = require 'lunar.peft'
local optim = require 'lunar.optim'

local case, out = arg[1] or 'glm5_dsa', arg[2] or '/tmp/lunar_peft_oracle'
local dir = 'tests/fixtures/models/' .. case
local model = lunar.model.load(dir)
local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
local batch = {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids,
               attention_mask = ref.attention_mask, cu_seqlens = ref.cu_seqlens}

local set = peft.apply(model, {targets = {'all-linear'}, r = 4, alpha = 8, dropout = 0.05, seed = 7})
local opt = optim.AdamW.new(set.params, {lr = 2e-2, weight_decay = 0.01, clip = 1.0})
local first
for step = 1, 5 do
    opt:zero_grad()
    local o = model:forward(batch, {loss = true})
    model:backward()
    opt:step{loss = o.loss}
    first = first or o.loss
end
set:eval()
local after = model:forward(batch, {loss = true, keep = false})
os.execute(('rm -rf %q; mkdir -p %q'):format(out, out))
peft.save(model, out .. '/adapter', {base_model_name_or_path = dir})
peft.save_merged(model, out .. '/merged')
local saved = {input_ids = ref.input_ids, position_ids = ref.position_ids, labels = ref.labels,
               logits = after.logits, loss = lunar.tensor({after.loss})}
if ref.attention_mask then saved.attention_mask = ref.attention_mask end
io_.save_safetensors(out .. '/lunar_reference.safetensors', saved)
print(('%s: %d adapters, loss %.6f before training, %.6f after 5 steps; written to %s'):format(
    case, #set.order, first, after.loss, out))
