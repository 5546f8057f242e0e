#!/usr/bin/env python3
"""PyTorch peer of zero-rs's GPT trainer, for benchmarks that compare.

Builds the same model as ``examples/src/trainer/gpt.rs`` -- byte vocabulary
(256), GPT-2 layout with pre-LN blocks, LayerNorm eps 1e-5, a qkv Linear
``[3d, d]`` whose output columns split as ``[3, heads, head_dim]``, causal
softmax attention scaled by ``1/sqrt(head_dim)``, GELU (tanh
approximation), an MLP of width ``4d``, a final LayerNorm, an output head
tied to ``wte.weight`` and learned positional embeddings, with the same
parameter names and shapes -- and trains it with ``torch.optim.AdamW``
(lr 1e-3, PyTorch's defaults otherwise, ``fused=True`` on CUDA) on batches
of ``context + 1`` byte windows, as ``examples/src/bench/gpt.rs`` does.

It prints ONE line of JSON on stdout::

    {"device": "cpu", "device_name": ..., "dtype": "f32", "attention": "manual",
     "tokens_per_s": ..., "step_ms_median": ..., "peak_rss_bytes": ...,
     "torch_version": ..., "threads": ..., ...}

Peak memory: on CUDA, ``peak_memory_bytes`` is
``torch.cuda.max_memory_allocated()`` over the timed steps (reset after the
warm-up), which counts the caching allocator's live tensors: model,
gradients, optimizer state, activations. On the CPU there is no such
counter, so ``peak_rss_bytes`` is the process's peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``) over its whole life: it includes the
Python interpreter and torch's own libraries (a few hundred MB; about 0.5 GB
for PyPI's CUDA-enabled wheel), so it is a different measure from the Rust
side's figures, which count heap bytes. ``rss_after_import_bytes`` is the
same counter read right after ``import torch``: the difference approximates
what the training itself holds.

Exit codes: 0 on success, 2 when PyTorch cannot be imported, 3 when the
asked-for device is unavailable, 4 for a bad shape. Messages go to stderr.
"""

import argparse
import json
import math
import platform
import resource
import statistics
import sys
import time
import warnings

EXIT_NO_TORCH = 2
EXIT_NO_DEVICE = 3
EXIT_USAGE = 4

VOCAB = 256
LR = 1e-3
TEXT_BYTES = 200_000


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train the zero-rs GPT in PyTorch and print its throughput as one JSON line."
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads per block")
    p.add_argument("--d-model", type=int, default=64, help="width of the residual stream")
    p.add_argument("--context", type=int, default=64, help="sequence length in bytes")
    p.add_argument(
        "--batch", type=int, default=32, help="sequences per step (global: ranks x per-rank batch)"
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--dtype",
        choices=["f32", "bf16"],
        default="f32",
        help="bf16: torch.autocast to bfloat16 with f32 weights",
    )
    p.add_argument(
        "--attention",
        choices=["manual", "sdpa"],
        default="manual",
        help="manual: q k^T / sqrt(d) + causal mask, softmax, @ v; "
        "sdpa: F.scaled_dot_product_attention(is_causal=True)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("layers", "heads", "d_model", "context", "batch", "steps"):
        if getattr(args, name) <= 0:
            fail(EXIT_USAGE, f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        fail(EXIT_USAGE, "--warmup must not be negative")
    if args.threads is not None and args.threads <= 0:
        fail(EXIT_USAGE, "--threads must be positive")
    if args.d_model % args.heads != 0:
        fail(
            EXIT_USAGE,
            f"--d-model {args.d_model} is not a multiple of --heads {args.heads}; "
            "pick a width that the heads divide",
        )
    return args


def fail(code, message):
    print(f"gpt_peer: {message}", file=sys.stderr)
    sys.exit(code)


def import_torch():
    # torch warns when numpy is absent; nothing here uses numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch  # noqa: F401
    except ImportError as e:
        fail(
            EXIT_NO_TORCH,
            f"PyTorch is not installed for {sys.executable} ({e}); install it with "
            f"`{sys.executable} -m pip install torch` (CPU-only wheel: add "
            "`--index-url https://download.pytorch.org/whl/cpu`)",
        )
    return torch


def build(torch, args):
    """The model class, defined once torch is importable."""
    nn = torch.nn
    F = torch.nn.functional

    class Attention(nn.Module):
        def __init__(self, d, heads, context, sdpa):
            super().__init__()
            self.heads = heads
            self.head_dim = d // heads
            self.sdpa = sdpa
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            if not sdpa:
                # [context, context]: 0 where a position may attend (itself
                # and earlier), -inf after it, as gpt.rs's causal_mask.
                mask = torch.full((context, context), float("-inf")).triu(1)
                self.register_buffer("mask", mask, persistent=False)

        def forward(self, x):
            b, t, d = x.shape
            # Output columns as [3, heads, head_dim], as gpt.rs reshapes.
            qkv = self.qkv(x).view(b, t, 3, self.heads, self.head_dim)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [b, h, t, hd]
            if self.sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
                # The softmax in f32 whatever the compute dtype, as the Rust
                # trainer does (and as CUDA autocast does for softmax).
                scores = scores.float() + self.mask[:t, :t]
                y = torch.softmax(scores, dim=-1).to(v.dtype) @ v
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    class Mlp(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.proj = nn.Linear(4 * d, d)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, d, heads, context, sdpa):
            super().__init__()
            self.ln1 = nn.LayerNorm(d, eps=1e-5)
            self.attn = Attention(d, heads, context, sdpa)
            self.ln2 = nn.LayerNorm(d, eps=1e-5)
            self.mlp = Mlp(d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Gpt(nn.Module):
        def __init__(self, layers, heads, d, context, sdpa):
            super().__init__()
            self.context = context
            self.wte = nn.Embedding(VOCAB, d)
            self.wpe = nn.Embedding(context, d)
            self.blocks = nn.ModuleList(Block(d, heads, context, sdpa) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d, eps=1e-5)
            # No head module: the output projection is wte.weight (tied).

        def reset_parameters(self, generator, layers):
            """GPT-2's scheme as gpt.rs draws it: uniform with std 0.02
            (bound 0.02 * sqrt(3)), residual projections std
            0.02 / sqrt(2 * layers), biases 0, norms 1."""
            std = 0.02
            residual_std = std / math.sqrt(2 * layers)
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if name.endswith("bias"):
                        p.zero_()
                    elif ".ln" in name or name.startswith("ln_f"):
                        p.fill_(1.0)
                    else:
                        s = residual_std if name.endswith("proj.weight") else std
                        bound = s * math.sqrt(3.0)
                        p.copy_(
                            torch.rand(p.shape, generator=generator) * (2 * bound) - bound
                        )

        def forward(self, ids):
            t = ids.shape[1]
            pos = torch.arange(t, device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            x = self.ln_f(x)
            return F.linear(x, self.wte.weight)  # the tied head

        def loss(self, ids):
            """Mean cross-entropy of each next byte of ids [batch, time + 1]."""
            logits = self(ids[:, :-1])
            targets = ids[:, 1:]
            return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))

    return Gpt(args.layers, args.heads, args.d_model, args.context, args.attention == "sdpa")


def expected_parameters(layers, d, context):
    """The count from gpt.rs's shapes: wte, wpe, per block ln1 + qkv + proj
    + ln2 + fc + proj, and ln_f (the head is tied: no parameters)."""
    per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return VOCAB * d + context * d + layers * per_block + 2 * d


def main(argv=None):
    args = parse_args(argv)
    torch = import_torch()
    # What the interpreter and torch's libraries hold before any model
    # (CPU only: peak_rss_bytes minus this approximates the training's own).
    rss_after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    if args.device == "cuda":
        if not torch.cuda.is_available():
            fail(
                EXIT_NO_DEVICE,
                f"--device cuda asked for, but torch {torch.__version__} sees no CUDA device "
                f"(built with CUDA {torch.version.cuda}); use --device cpu",
            )
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        device_name = platform.processor() or platform.machine() or "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        device_name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    if args.dtype == "bf16" and args.device == "cuda" and not torch.cuda.is_bf16_supported():
        fail(EXIT_NO_DEVICE, f"{device_name} does not support bf16; use --dtype f32")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = build(torch, args)
    model.reset_parameters(gen, args.layers)
    model.to(device)
    parameters = sum(p.numel() for p in model.parameters())
    expected = expected_parameters(args.layers, args.d_model, args.context)
    if parameters != expected:
        fail(EXIT_USAGE, f"internal: {parameters} parameters, gpt.rs's shapes give {expected}")

    opt_kwargs = {"lr": LR}
    if args.device == "cuda":
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)

    # Seeded random bytes in [32, 122): the content does not matter for timing.
    text = torch.randint(32, 122, (max(TEXT_BYTES, 2 * (args.context + 1)),), generator=gen)
    text = text.to(device)
    offsets = torch.arange(args.context + 1, device=device)
    starts_max = text.numel() - args.context - 1

    def batch():
        starts = torch.randint(0, starts_max + 1, (args.batch, 1), generator=gen).to(device)
        return text[starts + offsets]  # [batch, context + 1], int64

    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None

    def step():
        ids = batch()
        opt.zero_grad(set_to_none=True)
        if autocast_dtype is not None:
            with torch.autocast(device_type=device.type, dtype=autocast_dtype):
                loss = model.loss(ids)
        else:
            loss = model.loss(ids)
        loss.backward()
        opt.step()
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first_loss = None
    for _ in range(args.warmup):
        loss = step()
        if first_loss is None:
            first_loss = loss.item()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - started)
        if first_loss is None:
            first_loss = loss.item()
    final_loss = loss.item()
    if not math.isfinite(final_loss):
        fail(EXIT_USAGE, f"the loss is {final_loss}")

    median = statistics.median(times)
    out = {
        "device": device.type,
        "device_name": device_name,
        "dtype": args.dtype,
        "attention": args.attention,
        "tokens_per_s": args.batch * args.context / median,
        "step_ms_median": median * 1e3,
    }
    if device.type == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        # Linux reports ru_maxrss in KiB.
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["rss_after_import_bytes"] = rss_after_import
    out.update(
        {
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
            "layers": args.layers,
            "heads": args.heads,
            "d_model": args.d_model,
            "context": args.context,
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "parameters": parameters,
            "first_loss": first_loss,
            "final_loss": final_loss,
        }
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
