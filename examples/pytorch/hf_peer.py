#!/usr/bin/env python3
"""`transformers` peer of zero-rs's GPT-2 (``zero_candle::models::Gpt2``), for
``bench hf`` (``examples/src/bench/hf.rs``).

Loads a hub directory with ``GPT2LMHeadModel.from_pretrained`` (the tiny
fixture ``zero-candle/tests/fixtures/gpt2/tiny`` in the benchmark), trains it
with ``torch.optim.AdamW`` on batches of seeded random token ids below the
vocabulary size, ``[batch, context + 1]`` each, and prints ONE line of JSON
on stdout::

    {"device": "cpu", "device_name": ..., "tokens_per_s": ..., "step_ms_median": ...,
     "peak_rss_bytes": ..., "torch_version": ..., "transformers_version": ..., ...}

A step predicts ``batch * context`` tokens, as ``Gpt2::loss`` does on the
same ids: the model reads the first ``context`` tokens and each position
predicts the next (``shift_labels``). Plain ``labels=ids`` would read all
``context + 1`` tokens (more positions than the fixture's ``n_positions``)
and, since transformers pads the shifted labels with -100, predict only
``context`` of them while computing ``context + 1`` positions.

``peak_rss_bytes`` is the process's peak resident set size (interpreter,
torch and transformers included), as ``gpt_peer.py`` reports it on the CPU;
``rss_after_import_bytes`` is the same counter right after the imports.

Exit codes: 0 on success, 2 when torch or transformers cannot be imported,
4 for bad arguments. Messages go to stderr.
"""

import argparse
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
EXIT_USAGE = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a hub GPT-2 with transformers and print its throughput as one JSON line."
    )
    p.add_argument("--model-dir", required=True, help="hub directory (config.json, *.safetensors)")
    p.add_argument("--context", type=int, default=32, help="predicted tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
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


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        fail(EXIT_USAGE, f"{args.model_dir} has no config.json; pass a hub directory")
    torch, transformers = import_packages()
    rss_after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model = transformers.GPT2LMHeadModel.from_pretrained(args.model_dir)
    # The fixture's dropout is 0; train() all the same, as a trainer would.
    model.train()
    vocab = model.config.vocab_size
    if args.context > model.config.n_positions:
        fail(
            EXIT_USAGE,
            f"--context {args.context} is longer than the model's n_positions "
            f"{model.config.n_positions}",
        )
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=tuple(args.betas),
        eps=args.eps,
        weight_decay=args.weight_decay,
    )
    gen = torch.Generator().manual_seed(args.seed)

    def step():
        ids = torch.randint(0, vocab, (args.batch, args.context + 1), generator=gen)
        inputs = ids[:, :-1].contiguous()
        opt.zero_grad(set_to_none=True)
        # labels only switches the loss on; shift_labels are the targets
        # (see the module's doc). No cache: nothing is generated.
        loss = model(
            input_ids=inputs,
            labels=inputs,
            shift_labels=ids[:, 1:].contiguous(),
            use_cache=False,
        ).loss
        loss.backward()
        opt.step()
        return loss

    first_loss = None
    for _ in range(args.warmup):
        loss = step()
        if first_loss is None:
            first_loss = loss.item()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - started)
        if first_loss is None:
            first_loss = loss.item()
    final_loss = loss.item()
    if not math.isfinite(final_loss):
        fail(EXIT_USAGE, f"the loss is {final_loss}")

    median = statistics.median(times)
    out = {
        "device": "cpu",
        "device_name": cpu_name(),
        "tokens_per_s": args.batch * args.context / median,
        "step_ms_median": median * 1e3,
        # Linux reports ru_maxrss in KiB.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_import_bytes": rss_after_import,
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
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
