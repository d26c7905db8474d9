-- peft_reference.lua: lunar's logits for a LoRA adapter written by lunar (the lora recipe's
-- output.dir, or any lunar.peft.save directory), for tests/ref/check_peft.py.
--
--   ./build/lunar recipes/lora.lua train.steps=20 output.dir=/tmp/lora_run/final
--   ./build/lunar tests/ref/peft_reference.lua /tmp/lora_run/final /tmp/lora_check [BASE]
--   python3 tests/ref/check_peft.py /tmp/lora_check
--
-- BASE is the base checkpoint (default: the adapter's base_model_name_or_path, which the recipe
-- writes as <output.dir>/base for a seeded base). Writes to OUT:
--   adapter/                       a copy of the adapter files, base_model_name_or_path = BASE
--   merged/                        lunar.peft.save_merged of the loaded adapter
--   lunar_reference.safetensors    inputs (two rows of seeded random token ids, the second row
--                                  padded) and lunar's logits with the adapter in eval mode
local lunar = require 'lunar'
local io_ = require 'lunar.io'
local peft = require 'lunar.peft'

local src, out, base = arg[1], arg[2], arg[3]
if not src or not out then error('usage: lunar tests/ref/peft_reference.lua ADAPTER_DIR OUT [BASE]', 0) end
local cfg = io_.read_json(src .. '/adapter_config.json')
base = base or cfg.base_model_name_or_path
if type(base) ~= 'string' then error(src .. '/adapter_config.json: no base_model_name_or_path; give BASE', 0) end

local model = lunar.model.load(base)
local set = peft.load(model, src)
set:eval()

-- two rows of 24 tokens; the second has 6 padding positions at the end
local S, V = 24, model.cfg.vocab_size
local ids = lunar.randint(0, V, {2, S}, {rng = lunar.rng(11)})
local pos = lunar.empty({2, S}, {dtype = 'i64'})
local mask = lunar.ones({2, S}, {dtype = 'i64'})
for b = 1, 2 do for s = 1, S do pos:set(b, s, s - 1) end end
for s = S - 5, S do mask:set(2, s, 0) end
local logits = model:forward({input_ids = ids, position_ids = pos, attention_mask = mask}, {keep = false}).logits

os.execute(('rm -rf %q; mkdir -p %q'):format(out, out))
-- the adapter as written, with base_model_name_or_path pointing at BASE
os.execute(('mkdir -p %q && cp %q %q'):format(out .. '/adapter', src .. '/adapter_model.safetensors', out .. '/adapter/'))
cfg.base_model_name_or_path = base
io_.write_json(out .. '/adapter/adapter_config.json', cfg)
peft.save_merged(model, out .. '/merged')
io_.save_safetensors(out .. '/lunar_reference.safetensors',
    {input_ids = ids, position_ids = pos, attention_mask = mask, logits = logits})
print(('%s: %d adapters on %s; logits of 2 x %d tokens written to %s'):format(src, #set.order, base, S, out))
