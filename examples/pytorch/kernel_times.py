#!/usr/bin/env python3
"""PyTorch's side of zero-rs's fused-layer kernel timings (bench `gpu`,
``examples/src/bench/gpu_layers.rs``), at the GPT benchmark's shapes:

- attention: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
  forward + backward, q/k/v ``[batch, heads, T, head_dim]`` (PyTorch picks
  its fastest kernel: FlashAttention-2 for bf16, memory-efficient attention
  for f32), upstream gradient of ones;
- grouped attention in bf16: the same with ``enable_gqa=True`` (torch 2.5
  or newer), q ``[batch, --gqa-heads, T, --gqa-head-dim]``, k/v with
  ``--gqa-kv-heads`` heads;
- the 1.1B Llama's attention in bf16 (``bench gpu``'s TinyLlama shape:
  batch 4, T 2048, 32 query and 4 K/V heads of 64), and the same with 32
  K/V heads (long sequences without the grouping);
- LayerNorm: the backward of ``F.layer_norm`` over ``[rows, width]`` with
  weight and bias (the forward run once, then ``backward(retain_graph=True)``
  timed), upstream gradient of ones.

Times are CUDA-event milliseconds per call, averaged over ``--iters`` calls
after ``--warmup``. It prints ONE line of JSON on stdout::

    {"device_name": ..., "torch_version": ...,
     "attn_fwd_bwd_ms_f32": ..., "attn_fwd_bwd_ms_bf16": ...,
     "layer_norm_bwd_ms_f32": ..., "layer_norm_bwd_ms_bf16": ...,
     "attn_gqa_fwd_bwd_ms_bf16": ..., "attn_llama_fwd_bwd_ms_bf16": ...,
     "attn_llama_mha_fwd_bwd_ms_bf16": ...}

(the grouped ones missing when this torch's SDPA has no ``enable_gqa``).

Exit codes: 0 on success, 2 when PyTorch cannot be imported, 3 when there is
no CUDA device. Messages go to stderr.
"""

import argparse
import json
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--time", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--gqa-heads", type=int, default=32)
    p.add_argument("--gqa-kv-heads", type=int, default=8)
    p.add_argument("--gqa-head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"cannot import torch: {e}", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("torch sees no CUDA device", file=sys.stderr)
        sys.exit(3)

    device = torch.device("cuda")
    torch.manual_seed(0)

    def time_ms(f):
        for _ in range(args.warmup):
            f()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            f()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.iters

    b, h, t, d = args.batch, args.heads, args.time, args.head_dim
    out = {
        "device_name": torch.cuda.get_device_name(0),
        "torch_version": torch.__version__,
        "shape": {"batch": b, "heads": h, "time": t, "head_dim": d, "rows": b * t, "width": h * d},
    }
    for name, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        q, k, v = (
            torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
        )

        def attention():
            # No accumulation into .grad: each call's gradients are fresh.
            q.grad = k.grad = v.grad = None
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(torch.ones_like(y))

        out[f"attn_fwd_bwd_ms_{name}"] = time_ms(attention)

        x = torch.randn(b * t, h * d, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(h * d, device=device, dtype=dtype, requires_grad=True)
        bias = torch.randn(h * d, device=device, dtype=dtype, requires_grad=True)
        y = F.layer_norm(x, (h * d,), w, bias, 1e-5)
        upstream = torch.ones_like(y)

        def layer_norm_backward():
            x.grad = w.grad = bias.grad = None
            y.backward(upstream, retain_graph=True)

        out[f"layer_norm_bwd_ms_{name}"] = time_ms(layer_norm_backward)

    def grouped_ms(b, t, heads, kv_heads, d):
        q = torch.randn(b, heads, t, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(b, kv_heads, t, d, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2)
        )

        def grouped_attention():
            q.grad = k.grad = v.grad = None
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            y.backward(torch.ones_like(y))

        return time_ms(grouped_attention)

    gh, gkv, gd = args.gqa_heads, args.gqa_kv_heads, args.gqa_head_dim
    try:
        out["attn_gqa_fwd_bwd_ms_bf16"] = grouped_ms(b, t, gh, gkv, gd)
        out["gqa_shape"] = {"heads": gh, "kv_heads": gkv, "head_dim": gd}
        out["attn_llama_fwd_bwd_ms_bf16"] = grouped_ms(4, 2048, 32, 4, 64)
        out["attn_llama_mha_fwd_bwd_ms_bf16"] = grouped_ms(4, 2048, 32, 32, 64)
    except TypeError as e:  # no enable_gqa before torch 2.5
        print(f"grouped attention skipped: {e}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
