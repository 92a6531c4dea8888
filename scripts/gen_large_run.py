#!/usr/bin/env python3
"""Write a large training run to benchmark ckvc on: HF-Trainer-style
checkpoints of a GPT-2-small-sized model (~124M parameters, fp32, AdamW),
trained on the CPU for a few steps between saves.

    python3 scripts/gen_large_run.py /work/large-run            # 4 checkpoints, ~1.5 GB each
    python3 scripts/gen_large_run.py /tmp/run --checkpoints 2 --steps-between 1 --layers 2
    python3 scripts/gen_large_run.py /tmp/bf16-run --dtype bf16 --vocab 8192 --d 256 --layers 4 --heads 4
    python3 scripts/gen_large_run.py /tmp/lora-run --lora 16 --checkpoints 8   # a LoRA fine-tune

Each `checkpoint-N/` holds what transformers' Trainer writes:
model.safetensors (the weights, tied embeddings stored once), config.json,
optimizer.pt (AdamW state_dict: exp_avg, exp_avg_sq per parameter, via
torch.save), scheduler.pt, rng_state.pth, training_args.bin and
trainer_state.json (global_step, log_history with loss and learning rate).

With `--lora R` the run is a LoRA fine-tune as PEFT and the Trainer
save it: the model's weights are frozen, every attention and MLP
projection (transformers' GPT-2; the plain-torch clone: the MLP's) gets a
rank-R adapter (`lora_A` Kaiming-uniform, `lora_B` zero at the start,
scaled by 2), and each checkpoint holds adapter_model.safetensors (the
adapters only, PEFT's key names) and adapter_config.json instead of
model.safetensors, and an optimizer.pt of the adapters' AdamW state.

The model is built from a config (no model hub): transformers'
GPT2LMHeadModel when transformers is installed, else a plain-torch clone
of the same shapes. The data are random token sequences from a fixed
Zipf-like distribution (seeded), enough for the weights and the optimizer
moments to move the way they do in training. Needs torch and safetensors;
writes into OUT, which should be outside the ckvc repository.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
from safetensors.torch import save_file


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class PlainGPT2(nn.Module):
    """GPT-2 small's shapes in plain torch (used without transformers)."""

    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(t))
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        for b in self.h:
            x = b(x, mask)
        logits = self.ln_f(x) @ self.wte.weight.T
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )


def build(args):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=args.vocab,
            n_positions=args.ctx,
            n_embd=args.d,
            n_layer=args.layers,
            n_head=args.heads,
        )
        model = GPT2LMHeadModel(cfg)

        def loss(ids):
            return model(input_ids=ids, labels=ids).loss

        return model, loss, cfg.to_dict(), "transformers"
    except ImportError:
        model = PlainGPT2(args.vocab, args.ctx, args.d, args.layers, args.heads)
        cfg = dict(
            model_type="gpt2-plain-torch",
            vocab_size=args.vocab,
            n_positions=args.ctx,
            n_embd=args.d,
            n_layer=args.layers,
            n_head=args.heads,
        )
        return model, model, cfg, "plain torch"


def model_tensors(model, dtype=None):
    """The state dict as safetensors wants it: shared storage saved once
    (transformers ties lm_head to wte), every tensor contiguous; cast to
    `dtype` when given."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        t = t.detach()
        out[name] = (t.to(dtype) if dtype is not None else t).contiguous()
    return out


def add_lora(model, rank):
    """Rank-`rank` adapters on the projections of every block of `model`
    (transformers' attention c_attn / c_proj and MLP c_fc / c_proj; the
    plain-torch clone's MLP layers, its attention calls its projections
    without their forward), applied by forward hooks, with `model`'s own
    weights frozen. Returns {PEFT key name: adapter parameter} in module
    order."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = {}
    for name, mod in list(model.named_modules()):
        conv1d = type(mod).__name__ == "Conv1D"  # transformers' GPT-2: weight is (in, out)
        if ".h." not in f".{name}." or not (conv1d or (isinstance(mod, nn.Linear) and ".mlp." in name)):
            continue
        w = mod.weight
        d_in, d_out = (w.shape[0], w.shape[1]) if conv1d else (w.shape[1], w.shape[0])
        a = nn.Parameter(torch.empty(rank, d_in))
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b = nn.Parameter(torch.zeros(d_out, rank))
        mod.register_parameter("lora_A", a)
        mod.register_parameter("lora_B", b)

        def hook(m, inp, out):
            return out + (inp[0] @ m.lora_A.T @ m.lora_B.T) * 2.0

        mod.register_forward_hook(hook)
        prefix = f"base_model.model.{name}"
        adapters[f"{prefix}.lora_A.weight"] = a
        adapters[f"{prefix}.lora_B.weight"] = b
    return adapters


def save(out, step, model, cfg, opt, sched, state, args, adapters=None):
    d = os.path.join(out, f"checkpoint-{step}")
    tmp = d + ".partial"
    os.makedirs(tmp, exist_ok=True)
    saved = torch.float16 if args.dtype == "fp16" else None
    if adapters is not None:
        tensors = {k: t.detach().contiguous() for k, t in adapters.items()}
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        targets = sorted({k.split(".")[-3] for k in adapters})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": targets}, f)
    else:
        save_file(model_tensors(model, saved), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, default=str)
    torch.save(opt.state_dict(), os.path.join(tmp, "optimizer.pt"))
    torch.save(sched.state_dict(), os.path.join(tmp, "scheduler.pt"))
    torch.save(
        {
            "python": random.getstate(),
            "cpu": torch.get_rng_state(),
        },
        os.path.join(tmp, "rng_state.pth"),
    )
    torch.save(vars(args), os.path.join(tmp, "training_args.bin"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, d)
    return d


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--checkpoints", type=int, default=4)
    p.add_argument("--steps-between", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="fp32: fp32 training; bf16: the model cast to bfloat16 and trained so "
        "(weights and AdamW moments bf16); fp16: fp32 training, the weights saved as float16",
    )
    p.add_argument("--lora", type=int, default=0, metavar="R", help="a LoRA fine-tune of rank R (0: train every weight)")
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    model, loss_fn, cfg, impl = build(args)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    n = sum(t.numel() for t in model_tensors(model).values())
    print(f"{impl} GPT-2: {n / 1e6:.1f}M parameters (trained {args.dtype})", file=sys.stderr)

    trained, adapters = list(model.parameters()), None
    if args.lora:
        adapters = add_lora(model, args.lora)
        trained = list(adapters.values())
        n = sum(t.numel() for t in trained)
        print(f"LoRA rank {args.lora}: {n / 1e6:.2f}M trained parameters", file=sys.stderr)
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.01)
    total = args.checkpoints * args.steps_between
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 2) * 0.5 * (1 + math.cos(math.pi * s / max(total, 1)))
    )
    # Zipf-like token distribution: frequent tokens dominate, as in text.
    weights = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(args.seed)
    state = {"global_step": 0, "log_history": [], "epoch": 0.0}
    step = 0
    model.train()
    for _ in range(args.checkpoints):
        for _ in range(args.steps_between):
            t = time.time()
            ids = torch.multinomial(weights, args.batch * args.seq, replacement=True, generator=gen)
            loss = loss_fn(ids.view(args.batch, args.seq))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            state["log_history"].append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "learning_rate": sched.get_last_lr()[0],
                    "epoch": step / total,
                }
            )
            print(f"step {step} loss {loss.item():.4f} ({time.time() - t:.1f} s)", file=sys.stderr)
        state.update(global_step=step, epoch=step / total, loss=state["log_history"][-1]["loss"])
        d = save(args.out, step, model, cfg, opt, sched, state, args, adapters)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"wrote {d} ({size / 1e9:.2f} GB)", file=sys.stderr)


if __name__ == "__main__":
    main()
