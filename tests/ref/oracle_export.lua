-- oracle_export.lua: train one AdamW step on a fixture, export the model, and write the
-- inputs and lunar's logits after the step next to the export, for tests/ref/check_export.py
-- (transformers reloads the export strictly and recomputes the logits).
--
--   ./build/lunar tests/ref/oracle_export.lua CASE OUTDIR
--   python3 tests/ref/check_export.py OUTDIR/model OUTDIR/lunar_reference.safetensors
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local ops = lunar.ops
local case, out = arg[1] or 'glm5_dsa', arg[2] or '/tmp/lunar_oracle'
local dir = 'tests/fixtures/models/' .. case
local model = lunar.model.load(dir)
local ref = io_.load_checkpoint(dir .. '/reference.safetensors')
local batch = {input_ids = ref.input_ids, labels = ref.labels, position_ids = ref.position_ids,
               attention_mask = ref.attention_mask, cu_seqlens = ref.cu_seqlens}
local before = model:forward(batch, {loss = true})
model:backward()
-- one AdamW step on every parameter that has a gradient (lr large enough to move the logits)
local state = {}
for name, g in pairs(model:gradients()) do
    local p = model:parameters()[name]
    ops.adamw_step(p, g, lunar.zeros(p:size()), lunar.zeros(p:size()), {lr = 1e-2, step = 1, weight_decay = 0.01})
    state[name] = true
end
local after = model:forward(batch, {loss = true, keep = false})
os.execute(('mkdir -p %q'):format(out))
model:save_hf(out .. '/model')
local saved = {input_ids = ref.input_ids, position_ids = ref.position_ids, labels = ref.labels,
               logits = after.logits, loss = lunar.tensor({after.loss})}
if ref.attention_mask then saved.attention_mask = ref.attention_mask end
io_.save_safetensors(out .. '/lunar_reference.safetensors', saved)
print(('%s: loss %.6f before the step, %.6f after; exported to %s/model'):format(case, before.loss, after.loss, out))
