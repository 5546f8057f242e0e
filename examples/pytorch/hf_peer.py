#!/usr/bin/env python3
"""`transformers` peer of zero-rs's hub models (``zero_candle::models``'s GPT-2
and Llama), for ``bench hf`` (``examples/src/bench/hf.rs``) on the CPU and
``bench gpu``'s hub models (``examples/src/bench/gpu_gpt/hub_models.rs``) on CUDA.

The model is either a hub directory loaded with
``AutoModelForCausalLM.from_pretrained`` (``--model-dir``; the tiny fixtures
``zero-candle/tests/fixtures/gpt2/tiny`` and ``llama/gqa`` in ``bench
hf``) or a fresh model of a named shape with random weights (``--random
small``: ``GPT2Config()``'s GPT-2 small, 124M parameters, dropout off as
training here has none; ``--random tinyllama``: TinyLlama-1.1B's Llama
shape). It is trained with ``torch.optim.AdamW`` (``fused=True`` on
CUDA) on batches of seeded random token ids below the vocabulary size,
``[batch, context + 1]`` each, and prints ONE line of JSON on stdout::

    {"device": "cpu", "device_name": ..., "dtype": "f32", "attention": "sdpa",
     "tokens_per_s": ..., "step_ms_median": ..., "peak_rss_bytes": ...,
     "torch_version": ..., "transformers_version": ..., "parameters": ..., ...}

A step predicts ``batch * context`` tokens, as ``Gpt2::loss`` does on the
same ids: the model reads the first ``context`` tokens and each position
predicts the next (``shift_labels``). Plain ``labels=ids`` would read all
``context + 1`` tokens (more positions than the fixture's ``n_positions``)
and, since transformers pads the shifted labels with -100, predict only
``context`` of them while computing ``context + 1`` positions.

``--dtype bf16`` runs the forward pass under ``torch.autocast`` to bfloat16
with f32 weights and optimizer state, as ``gpt_peer.py`` does.
``--attn-implementation`` is transformers' (``eager``: the matmul, mask and
softmax composition; ``sdpa``: ``F.scaled_dot_product_attention``); without
it, transformers chooses.

Memory: on CUDA, ``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated()``
over the timed steps (reset after the warm-up). On the CPU,
``peak_rss_bytes`` is the process's peak resident set size (interpreter,
torch and transformers included), as ``gpt_peer.py`` reports it;
``rss_after_import_bytes`` is the same counter right after the imports.

Exit codes: 0 on success, 2 when torch or transformers cannot be imported,
3 when the asked-for device (or bf16 on it) is unavailable, 4 for bad
arguments. Messages go to stderr.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import warnings

EXIT_NO_PACKAGE = 2
EXIT_NO_DEVICE = 3
EXIT_USAGE = 4

# The fresh models --random builds: a transformers config class's name and
# its keyword arguments.
RANDOM_SHAPES = {
    # GPT2Config()'s defaults are GPT-2 small's shape (vocabulary 50257,
    # 1024 positions, 12 layers of 768 with 12 heads); dropout off.
    "small": ("GPT2Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    # TinyLlama-1.1B's shape (1.1B parameters): 22 layers of 2048, 32 query
    # heads sharing 4 key/value heads, MLP 5632, vocabulary 32000, untied.
    "tinyllama": (
        "LlamaConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # A small Qwen3-MoE (13.6M parameters): 4 layers of 256, 8 query heads
    # of 32 sharing 4 key/value heads, every MLP 32 experts of 128 with 4
    # per token (normalized), vocabulary 384, untied.
    "qwen3moe_small": (
        "Qwen3MoeConfig",
        {
            "vocab_size": 384,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 128,
            "norm_topk_prob": True,
            "max_position_embeddings": 512,
            "tie_word_embeddings": False,
        },
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a hub model with transformers and print its throughput as one JSON line."
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-dir", help="hub directory (config.json, *.safetensors)")
    model.add_argument(
        "--random",
        choices=sorted(RANDOM_SHAPES),
        help="a fresh model of this shape with seeded random weights",
    )
    p.add_argument("--context", type=int, default=32, help="predicted tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--dtype",
        choices=["f32", "bf16"],
        default="f32",
        help="bf16: torch.autocast to bfloat16 with f32 weights",
    )
    p.add_argument(
        "--attn-implementation",
        choices=["eager", "sdpa"],
        default=None,
        help="transformers' attention (default: transformers chooses)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    # argparse's own exit code (2) is EXIT_NO_PACKAGE's: a flag the script
    # does not know is a usage error.
    p.error = lambda message: fail(EXIT_USAGE, message)
    args = p.parse_args(argv)
    for name in ("context", "batch", "steps"):
        if getattr(args, name) <= 0:
            fail(EXIT_USAGE, f"--{name} must be positive")
    if args.warmup < 0:
        fail(EXIT_USAGE, "--warmup must not be negative")
    if args.threads is not None and args.threads <= 0:
        fail(EXIT_USAGE, "--threads must be positive")
    return args


def fail(code, message):
    print(f"hf_peer: {message}", file=sys.stderr)
    sys.exit(code)


def import_packages():
    # torch warns when numpy is absent; nothing here uses numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch
    except ImportError as e:
        fail(
            EXIT_NO_PACKAGE,
            f"PyTorch is not installed for {sys.executable} ({e}); install it with "
            f"`{sys.executable} -m pip install torch transformers`",
        )
    try:
        import transformers
    except ImportError as e:
        fail(
            EXIT_NO_PACKAGE,
            f"transformers is not installed for {sys.executable} ({e}); install it with "
            f"`{sys.executable} -m pip install transformers`",
        )
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return torch, transformers


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def open_device(torch, args):
    """The torch device and its name; exits with EXIT_NO_DEVICE when CUDA
    (or bf16 on it) is asked for and unavailable."""
    if args.device == "cpu":
        return torch.device("cpu"), cpu_name()
    if not torch.cuda.is_available():
        fail(
            EXIT_NO_DEVICE,
            f"--device cuda asked for, but torch {torch.__version__} sees no CUDA device "
            f"(built with CUDA {torch.version.cuda}); use --device cpu",
        )
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    if args.dtype == "bf16" and not torch.cuda.is_bf16_supported():
        fail(EXIT_NO_DEVICE, f"{name} does not support bf16; use --dtype f32")
    return device, name


def build_model(transformers, args):
    """The model to train: loaded from --model-dir (whatever causal LM it
    holds), or a fresh one of --random's shape (weights from torch's seeded
    generator)."""
    attention = {}
    if args.attn_implementation is not None:
        attention["attn_implementation"] = args.attn_implementation
    if args.model_dir is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, **attention)
    kind, shape = RANDOM_SHAPES[args.random]
    config = getattr(transformers, kind)(**shape)
    return transformers.AutoModelForCausalLM.from_config(config, **attention)


def main(argv=None):
    args = parse_args(argv)
    if args.model_dir is not None and not os.path.isfile(
        os.path.join(args.model_dir, "config.json")
    ):
        fail(EXIT_USAGE, f"{args.model_dir} has no config.json; pass a hub directory")
    torch, transformers = import_packages()
    rss_after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    device, device_name = open_device(torch, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model = build_model(transformers, args).to(device)
    # Dropout is 0 (the fixture's, and --random's); train() all the same,
    # as a trainer would.
    model.train()
    vocab = model.config.vocab_size
    # GPT-2 names its longest sequence n_positions, Llama max_position_embeddings.
    key = "n_positions" if hasattr(model.config, "n_positions") else "max_position_embeddings"
    positions = getattr(model.config, key)
    if args.context > positions:
        fail(EXIT_USAGE, f"--context {args.context} is longer than the model's {key} {positions}")
    opt_kwargs = {}
    if device.type == "cuda":
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=tuple(args.betas),
        eps=args.eps,
        weight_decay=args.weight_decay,
        **opt_kwargs,
    )
    gen = torch.Generator().manual_seed(args.seed)
    if args.dtype == "bf16":
        def autocast():
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext

    def step():
        ids = torch.randint(0, vocab, (args.batch, args.context + 1), generator=gen).to(device)
        inputs = ids[:, :-1].contiguous()
        opt.zero_grad(set_to_none=True)
        # labels only switches the loss on; shift_labels are the targets
        # (see the module's doc). No cache: nothing is generated.
        with autocast():
            loss = model(
                input_ids=inputs,
                labels=inputs,
                shift_labels=ids[:, 1:].contiguous(),
                use_cache=False,
            ).loss
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
            "transformers_version": transformers.__version__,
            "attention": model.config._attn_implementation,
            "threads": torch.get_num_threads(),
            "context": args.context,
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "parameters": sum(p.numel() for p in model.parameters()),
            "first_loss": first_loss,
            "final_loss": final_loss,
        }
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
