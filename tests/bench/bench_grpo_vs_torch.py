#!/usr/bin/env python3
"""bench_grpo_vs_torch.py: one GRPO step of the tiny preset (recipes/gsm8k.lua preset=tiny), lunar vs
a PyTorch stack (transformers generate + a torch loss + torch.optim.AdamW), CPU, f32, same threads,
same model, prompts, batch and lengths, measured in one run, each side in its own process.

    python3 tests/bench/bench_grpo_vs_torch.py [--lunar build/lunar] [--threads 1] [--prompts 8]
        [--n 8] [--new 128] [--mini-batches 2] [--micro-batch 8] [--steps 3] [--warmup 1]

Developer-machine benchmark (needs torch and transformers==5.25.0; CI never runs it).

The model is the tiny preset's GlmMoeDsaForCausalLM from its seeded init (seed 1234), written by
lunar as an HF checkpoint (tests/bench/bench_grpo_step.lua export=DIR) and loaded by transformers
in f32 with its default implementations (sdpa attention, grouped_mm experts: on this CPU the
fastest of transformers' choices for the forward and backward). The prompts are the first
--prompts GSM8K questions of examples/data/rl/gsm8k_train.jsonl with the GSM8K instruction,
rendered with the GLM-5 chat template: lunar.chat on one side, the tokenizer's chat template
(apply_chat_template) on the other, checked to give the same ids.

One step on each side:
  generate      --n samples per prompt, --new tokens each, temperature 1, no top-k/top-p, no stop
                token (lunar: no stop ids; transformers: min_new_tokens = max_new_tokens), then the
                reward (the first "#### N" equals the gold: 1, else 0)
  old logprobs  the policy's and the frozen reference's (KL k3, coef 0.001) log-probs of every
                response token at the temperature, no grad, in the training micro-batches; the
                GRPO advantages (per group (s - mean) / (std + 1e-6), std unbiased)
  train         --mini-batches optimizer steps, each over its micro-batches of --micro-batch
                responses: forward with grad, the PPO clipped (0.2) token-mean loss + 0.001 k3 KL,
                backward, gradient clip 1.0, AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.01)
lunar runs trainer.lua's step (lunar.rl.rollout, .batch, .policy): packed micro-batches (no
padding; a group's samples share one copy of their prompt, rl.share_prompts), routing replay of
generation's experts, entropy and the rollout/train log-prob gap logged. The PyTorch side pads each micro-batch to its longest sequence (right padding with an
attention mask; left padding for generate), routes afresh, and computes the entropy of the
response tokens without grad as a metric. The first --warmup steps of each side are not timed
(allocator and thread-pool start-up). Both processes stay up and take turns step by step (the
first of each pair alternating), so that the shared machine's changing load reaches both; the
table shows medians of the measured steps: wall seconds and the process's CPU seconds (user +
system of all its threads, which a loaded machine inflates less than wall time; with several
threads it includes their spin-waits).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

TORCH_RUNNER = r'''
import json, re, sys, time, torch
import transformers
transformers.logging.set_verbosity_error()
from transformers import AutoTokenizer, GlmMoeDsaForCausalLM
d, NEW, MB, MICRO, threads = sys.argv[1], *map(int, sys.argv[2:6])
torch.set_num_threads(threads)
meta = json.load(open(d + "/prompts.json"))
rl, ro, oc = meta["rl"], meta["rollout"], meta["optim"]
N, T = rl["n"], float(ro["temperature"])
tok = AutoTokenizer.from_pretrained(d)
suffix = ' Let\'s think step by step and output the final answer after "####".'
prompts = []
for p in meta["prompts"]:
    enc = tok.apply_chat_template([{"role": "user", "content": p["question"] + suffix}], add_generation_prompt=True,
                                  tokenize=True, enable_thinking=bool(ro["enable_thinking"]))
    ids = list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)
    if ids != p["ids"]:
        sys.exit("the chat template's ids differ from lunar.chat's for " + repr(p["question"][:60]))
    prompts.append(ids)
golds = [p["gold"] for p in meta["prompts"]]
P = len(prompts)
PAD = 6256

def load():
    return GlmMoeDsaForCausalLM.from_pretrained(d, dtype=torch.float32, use_kernels=False)
model, ref = load(), load()
ref.eval().requires_grad_(False)
impl = "%s attention, %s experts" % (model.config._attn_implementation,
                                     getattr(model.config, "_experts_implementation", "?"))
decay, no_decay = [], []
for name, p in model.named_parameters():
    (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
opt = torch.optim.AdamW([{"params": decay, "weight_decay": oc["weight_decay"]},
                         {"params": no_decay, "weight_decay": 0.0}], lr=oc["lr"], betas=tuple(oc["betas"]),
                        eps=oc["eps"])
answer = re.compile(r"#### (\-?[0-9\.\,]+)")

def reward(text, gold):
    m = answer.search(text)
    return 1.0 if m and m.group(1).replace(",", "") == gold else 0.0

def micro_batches(seqs):
    # right-padded (B, L) ids, attention mask, and the (B, NEW) positions predicting each response token
    out = []
    for i in range(0, len(seqs), MICRO):
        part = seqs[i:i + MICRO]
        L = max(len(p) + len(r) for p, r in part)
        ids = torch.full((len(part), L), PAD, dtype=torch.long)
        mask = torch.zeros((len(part), L), dtype=torch.long)
        at = torch.zeros((len(part), NEW), dtype=torch.long)
        for b, (p, r) in enumerate(part):
            ids[b, :len(p) + len(r)] = torch.tensor(p + r)
            mask[b, :len(p) + len(r)] = 1
            at[b] = torch.arange(len(p) - 1, len(p) - 1 + NEW)
        tgt = ids.gather(1, at + 1)
        out.append((ids, mask, at, tgt))
    return out

def logprobs(m, mb, with_entropy=False):
    ids, mask, at, tgt = mb
    logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
    V = logits.size(-1)
    z = logits.gather(1, at.unsqueeze(-1).expand(-1, -1, V)) / T          # (B, NEW, V)
    lsm = torch.log_softmax(z, -1)
    lp = lsm.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = -(lsm.exp() * lsm).sum(-1)
    return lp, ent

def step():
    t0, c0 = time.time(), time.process_time()
    # generate: left-padded prompts, n samples each, exactly NEW tokens
    L = max(len(p) for p in prompts)
    ids = torch.full((P, L), PAD, dtype=torch.long)
    am = torch.zeros((P, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        am[i, L - len(p):] = 1
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=T, top_k=0, top_p=1.0,
                             num_return_sequences=N, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=PAD)
    t_sampled = time.time()
    responses = out[:, L:].tolist()
    texts = tok.batch_decode(responses, skip_special_tokens=False)
    scores = torch.tensor([reward(t, golds[i // N]) for i, t in enumerate(texts)])
    t_gen, c_gen = time.time(), time.process_time()
    # old and reference logprobs in the training micro-batches; GRPO advantages
    seqs = [(prompts[i // N], responses[i]) for i in range(P * N)]
    per_mini = P * N // MB
    minis = [micro_batches(seqs[k * per_mini:(k + 1) * per_mini]) for k in range(MB)]
    old, refl = [], []
    with torch.no_grad():
        for mini in minis:
            old.append([logprobs(model, mb)[0] for mb in mini])
            refl.append([logprobs(ref, mb)[0] for mb in mini])
    g = scores.view(P, N)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + rl["std_eps"])).view(-1)
    t_old, c_old = time.time(), time.process_time()
    # train: one optimizer step per mini-batch, token-mean over the mini-batch
    model.train()
    losses = []
    for k, mini in enumerate(minis):
        tokens = per_mini * NEW
        total = 0.0
        for j, mb in enumerate(mini):
            lp, ent = logprobs(model, mb, with_entropy=True)
            a = adv[k * per_mini + j * MICRO:k * per_mini + j * MICRO + lp.size(0)].unsqueeze(1)
            r = torch.exp(torch.clamp(lp - old[k][j], -20, 20))
            pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - rl["eps_low"], 1 + rl["eps_high"]))
            x = torch.clamp(-(lp - refl[k][j]), -20, 20)
            kl = torch.clamp(torch.exp(x) - x - 1, -10, 10)
            loss = (pg + rl["kl_coef"] * kl).sum() / tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), oc["clip_grad"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    t_end, c_end = time.time(), time.process_time()
    return {"cpu_generate": c_gen - c0, "cpu_old_logprobs": c_old - c_gen, "cpu_train": c_end - c_old,
            "cpu_step": c_end - c0,"generate": t_gen - t0, "old_logprobs": t_old - t_gen, "train": t_end - t_old, "step": t_end - t0,
            "gen_tokens": P * N * NEW, "gen_seconds": t_sampled - t0, "loss": sum(losses) / len(losses),
            "reward_sum": scores.sum().item()}

# one step per line read from stdin ("step"; "quit" or the end ends), one JSON line back
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "step":
        break
    r = step()
    r.update(impl="pytorch", threads=threads, hf_impl=impl)
    print(json.dumps(r), flush=True)
'''

PHASES = [("generate", "generate (+ rewards)"), ("old_logprobs", "old + ref logprobs"), ("train", "train"),
          ("step", "whole step")]


class Side:
    """one implementation's process, running a step each time it is asked"""

    def __init__(self, name, cmd, env, log):
        self.name, self.log = name, log
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True)
        self.read("ready")

    def read(self, want=None):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.flush()
            with open(self.log.name) as f:
                tail = f.read()[-3000:]
            sys.exit(f"the {self.name} run failed (exit {self.proc.returncode}); the end of its log:\n{tail}")
        if want is not None:
            if line.strip() != want:
                sys.exit(f"the {self.name} run said {line.strip()!r}, expected {want!r}")
            return None
        return json.loads(line)

    def step(self):
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lunar", default="build/lunar")
    # 1 by default: docs/rl.md's figure; --threads 2 is the other setting it reports
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    if a.prompts % a.mini_batches != 0 or (a.prompts * a.n // a.mini_batches) % a.micro_batch != 0:
        sys.exit("--prompts must split evenly into --mini-batches, and each mini-batch into micro-batches of "
                 "--micro-batch responses")
    import torch
    import transformers
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), LUNAR_THREADS=str(a.threads))
    shape = [f"prompts={a.prompts}", f"n={a.n}", f"new={a.new}", f"mini_batches={a.mini_batches}",
             f"micro_batch={a.micro_batch}"]
    rows = {"lunar": [], "pytorch": []}
    loads = []
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([a.lunar, "tests/bench/bench_grpo_step.lua", f"export={d}"] + shape, check=True, env=env)
        with open(os.path.join(d, "torch.log"), "w") as tlog, open(os.path.join(d, "lunar.log"), "w") as llog:
            sides = [Side("pytorch", [sys.executable, "-c", TORCH_RUNNER, d, str(a.new), str(a.mini_batches),
                                      str(a.micro_batch), str(a.threads)], env, tlog),
                     Side("lunar", [a.lunar, "tests/bench/bench_grpo_step.lua", "serve=true"] + shape, env, llog)]
            # the sides take turns step by step (the first of each pair alternates), so that a change
            # in the machine's load reaches both
            for i in range(a.warmup + a.steps):
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    r = side.step()
                    load = os.getloadavg()[0]
                    tag = "warm-up" if i < a.warmup else "measured"
                    print(f"step {i + 1} ({tag}) {side.name:8s} generate {r['generate']:6.2f} s  old logprobs "
                          f"{r['old_logprobs']:6.2f} s  train {r['train']:6.2f} s  step {r['step']:6.2f} s  "
                          f"(cpu {r['cpu_step']:6.2f} s)  load {load:.2f}", flush=True)
                    if i >= a.warmup:
                        rows[side.name].append(r)
                        loads.append(load)
            for side in sides:
                side.close()
    lu, pt = rows["lunar"], rows["pytorch"]
    print(f"tiny preset GRPO step: {a.prompts} prompts x {a.n} samples x {a.new} new tokens, {a.mini_batches} "
          f"mini-batches of micro-batches of {a.micro_batch}, KL k3 to a reference copy, {a.threads} threads, f32; "
          f"median of {a.steps} interleaved step(s) after {a.warmup} warm-up; transformers "
          f"{transformers.__version__} ({pt[0]['hf_impl']}) + torch.optim.AdamW, torch {torch.__version__}; "
          f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs")
    print(f"  {'phase':22s} {'lunar s':>9s} {'torch s':>9s} {'ratio':>7s}   {'lunar cpu s':>11s} {'torch cpu s':>11s} "
          f"{'ratio':>7s}")
    for key, name in PHASES:
        ml, mp = median([r[key] for r in lu]), median([r[key] for r in pt])
        cl, cp = median([r["cpu_" + key] for r in lu]), median([r["cpu_" + key] for r in pt])
        print(f"  {name:22s} {ml:9.2f} {mp:9.2f} {mp / ml:6.2f}x   {cl:11.2f} {cp:11.2f} {cp / max(cl, 1e-9):6.2f}x")
    tl = median([r["gen_tokens"] / r["gen_seconds"] for r in lu])
    tp = median([r["gen_tokens"] / r["gen_seconds"] for r in pt])
    print(f"  generation tokens/s    {tl:9.1f} {tp:9.1f} {tl / tp:6.2f}x")
    pairs = [p["step"] / l["step"] for l, p in zip(lu, pt)]
    print(f"ratio: lunar {median([r['step'] for r in pt]) / median([r['step'] for r in lu]):.2f}x faster on the "
          f"whole step (floor 3x); per step pair: {', '.join(f'{x:.2f}x' for x in pairs)}")


if __name__ == "__main__":
    main()
