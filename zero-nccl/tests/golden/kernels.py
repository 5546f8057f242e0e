#!/usr/bin/env python3
"""Golden values for zero-nccl/tests/gpu_kernels.rs, from torch.optim itself.

Runs torch.optim.{SGD, Adam, AdamW, Adagrad, RMSprop} (single-tensor
implementations, float32, CPU) on the inputs the Rust test generates, and
writes the final parameters and optimizer state to kernels.rs next to this
file, as f32 bit patterns (exact, and no JSON parser needed in the test).

    pip install torch
    python3 zero-nccl/tests/golden/kernels.py

Every case and its hyperparameters live here; the Rust test reads them from
kernels.rs, so the two cannot drift apart.
"""

import os
import sys

import torch

N = 300  # elements per tensor: two blocks of 256 threads
STEPS = 10
MASK = (1 << 64) - 1


def values(seed, n):
    """The Rust test's `values`: deterministic f32 values in [-1, 1), exact."""
    s = (seed * 6364136223846793005 + 1442695040888963407) & MASK
    out = []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) & MASK
        out.append(((s >> 40) / (1 << 24)) * 2.0 - 1.0)
    return torch.tensor(out, dtype=torch.float32)


def bits(t):
    return [x & 0xFFFFFFFF for x in t.detach().contiguous().view(torch.int32).tolist()]


def run(make, n=N, steps=STEPS):
    """Steps one parameter of `values(1, n)` with gradients `values(100 + t, n)`."""
    p = torch.nn.Parameter(values(1, n))
    opt = make([p])
    for t in range(steps):
        p.grad = values(100 + t, n)
        opt.step()
    return p, opt.state[p]


def rust_bool(b):
    return "true" if b else "false"


def rust_f64(x):
    r = repr(float(x))
    return r if ("." in r or "e" in r or "inf" in r or "nan" in r) else r + ".0"


def rust_bits(name, t):
    data = ", ".join(f"0x{b:08x}" for b in bits(t))
    return f"        {name}: &[{data}],\n"


def rust_opt_bits(name, t):
    if t is None:
        return f"        {name}: None,\n"
    data = ", ".join(f"0x{b:08x}" for b in bits(t))
    return f"        {name}: Some(&[{data}]),\n"


def sgd_cases():
    out = []
    # (momentum, dampening, nesterov, weight_decay, maximize): 1 - 0.999 in
    # f32 is 1.3e-5 away from the f64 complement torch uses.
    for momentum, dampening, nesterov, wd, maximize in [
        (0.0, 0.0, False, 0.0, False),
        (0.9, 0.0, False, 0.01, False),
        (0.9, 0.0, True, 0.0, True),
        (0.5, 0.3, False, 0.1, False),
        (0.1, 0.999, False, 0.0, False),
    ]:
        lr = 0.05
        p, state = run(
            lambda ps: torch.optim.SGD(
                ps, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                weight_decay=wd, maximize=maximize, foreach=False,
            )
        )
        out.append(
            "    SgdCase {\n"
            f"        lr: {rust_f64(lr)},\n"
            f"        momentum: {rust_f64(momentum)},\n"
            f"        dampening: {rust_f64(dampening)},\n"
            f"        nesterov: {rust_bool(nesterov)},\n"
            f"        weight_decay: {rust_f64(wd)},\n"
            f"        maximize: {rust_bool(maximize)},\n"
            + rust_bits("params", p)
            + rust_opt_bits("momentum_buffer", state.get("momentum_buffer"))
            + "    },\n"
        )
    return "pub const SGD: &[SgdCase] = &[\n" + "".join(out) + "];\n"


# Momentum switched on mid-run over three parameters that the device steps as
# three segments of one flat state (`SGD_MIDRUN_AT`, with padding between).
# Step 4 turns momentum on; `b` has no gradient then, so its buffer starts
# one step later. Every buffer must start as a copy of the gradient.
MIDRUN_LENS = [300, 200, 100]
MIDRUN_AT = [0, 320, 540]
MIDRUN_STATE_LEN = 640
MIDRUN_STEPS = 6
MIDRUN_MOMENTUM_FROM = 4  # 1-based step
MIDRUN_SKIP = (4, 1)  # (step, parameter) without a gradient


def sgd_midrun():
    params = [torch.nn.Parameter(values(1 + j, n)) for j, n in enumerate(MIDRUN_LENS)]
    lr, momentum, dampening = 0.05, 0.9, 0.5
    opt = torch.optim.SGD(params, lr=lr, momentum=0.0, dampening=dampening, foreach=False)
    for step in range(1, MIDRUN_STEPS + 1):
        opt.param_groups[0]["momentum"] = momentum if step >= MIDRUN_MOMENTUM_FROM else 0.0
        for j, (p, n) in enumerate(zip(params, MIDRUN_LENS)):
            p.grad = None if (step, j) == MIDRUN_SKIP else values(100 + 10 * step + j, n)
        opt.step()
    out = (
        f"pub const SGD_MIDRUN_LENS: [usize; 3] = {MIDRUN_LENS};\n"
        f"pub const SGD_MIDRUN_AT: [usize; 3] = {MIDRUN_AT};\n"
        f"pub const SGD_MIDRUN_STATE_LEN: usize = {MIDRUN_STATE_LEN};\n"
        f"pub const SGD_MIDRUN_STEPS: usize = {MIDRUN_STEPS};\n"
        f"pub const SGD_MIDRUN_MOMENTUM_FROM: usize = {MIDRUN_MOMENTUM_FROM};\n"
        f"pub const SGD_MIDRUN_SKIP: (usize, usize) = {MIDRUN_SKIP};\n"
        f"pub const SGD_MIDRUN_HYPER: (f64, f64, f64) = "
        f"({rust_f64(lr)}, {rust_f64(momentum)}, {rust_f64(dampening)});\n"
        "pub const SGD_MIDRUN: [Midrun; 3] = [\n"
    )
    for p in params:
        out += "    Midrun {\n" + rust_bits("params", p)
        out += rust_bits("momentum_buffer", opt.state[p]["momentum_buffer"]) + "    },\n"
    return out + "];\n"


def adam_cases():
    out = []
    # (decoupled, amsgrad, maximize, weight_decay); betas (0.9, 0.999):
    # 1 - 0.999 in f32 is 1.3e-5 away from torch's complement.
    for decoupled, amsgrad, maximize, wd in [
        (False, False, False, 0.0),
        (False, True, False, 0.01),
        (True, False, True, 0.01),
        (True, True, False, 0.1),
    ]:
        lr = 1e-2
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        p, state = run(
            lambda ps: cls(
                ps, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd,
                amsgrad=amsgrad, maximize=maximize, foreach=False,
            )
        )
        out.append(
            "    AdamCase {\n"
            f"        lr: {rust_f64(lr)},\n"
            f"        betas: ({rust_f64(0.9)}, {rust_f64(0.999)}),\n"
            f"        eps: {rust_f64(1e-8)},\n"
            f"        weight_decay: {rust_f64(wd)},\n"
            f"        amsgrad: {rust_bool(amsgrad)},\n"
            f"        maximize: {rust_bool(maximize)},\n"
            f"        decoupled_weight_decay: {rust_bool(decoupled)},\n"
            + rust_bits("params", p)
            + rust_bits("exp_avg", state["exp_avg"])
            + rust_bits("exp_avg_sq", state["exp_avg_sq"])
            + rust_opt_bits("max_exp_avg_sq", state.get("max_exp_avg_sq"))
            + "    },\n"
        )
    return "pub const ADAM: &[AdamCase] = &[\n" + "".join(out) + "];\n"


def adagrad_cases():
    lr, lr_decay, wd, init, eps = 0.1, 0.01, 0.01, 0.1, 1e-10
    p, state = run(
        lambda ps: torch.optim.Adagrad(
            ps, lr=lr, lr_decay=lr_decay, weight_decay=wd,
            initial_accumulator_value=init, eps=eps, foreach=False,
        )
    )
    return (
        "pub const ADAGRAD: &[AdagradCase] = &[\n    AdagradCase {\n"
        f"        lr: {rust_f64(lr)},\n"
        f"        lr_decay: {rust_f64(lr_decay)},\n"
        f"        weight_decay: {rust_f64(wd)},\n"
        f"        initial_accumulator_value: {rust_f64(init)},\n"
        f"        eps: {rust_f64(eps)},\n"
        + rust_bits("params", p)
        + rust_bits("sum", state["sum"])
        + "    },\n];\n"
    )


def rmsprop_cases():
    out = []
    # (centered, momentum, alpha): 1 - 0.999 in f32 is 1.3e-5 away from
    # torch's complement.
    for centered, momentum, alpha in [
        (False, 0.0, 0.99),
        (True, 0.0, 0.999),
        (True, 0.9, 0.999),
        (False, 0.5, 0.999),
    ]:
        lr, wd, eps = 1e-2, 0.01, 1e-8
        p, state = run(
            lambda ps: torch.optim.RMSprop(
                ps, lr=lr, alpha=alpha, eps=eps, weight_decay=wd, momentum=momentum,
                centered=centered, foreach=False,
            )
        )
        out.append(
            "    RmspropCase {\n"
            f"        lr: {rust_f64(lr)},\n"
            f"        alpha: {rust_f64(alpha)},\n"
            f"        eps: {rust_f64(eps)},\n"
            f"        weight_decay: {rust_f64(wd)},\n"
            f"        momentum: {rust_f64(momentum)},\n"
            f"        centered: {rust_bool(centered)},\n"
            + rust_bits("params", p)
            + rust_bits("square_avg", state["square_avg"])
            + rust_opt_bits("grad_avg", state.get("grad_avg"))
            + rust_opt_bits("momentum_buffer", state.get("momentum_buffer"))
            + "    },\n"
        )
    return "pub const RMSPROP: &[RmspropCase] = &[\n" + "".join(out) + "];\n"


TYPES = """
/// One SGD run of `STEPS` steps and torch's result.
pub struct SgdCase {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub maximize: bool,
    pub params: &'static [u32],
    pub momentum_buffer: Option<&'static [u32]>,
}

/// One parameter of the SGD run that switches momentum on mid-run.
pub struct Midrun {
    pub params: &'static [u32],
    pub momentum_buffer: &'static [u32],
}

/// One Adam or AdamW run and torch's result.
pub struct AdamCase {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub amsgrad: bool,
    pub maximize: bool,
    pub decoupled_weight_decay: bool,
    pub params: &'static [u32],
    pub exp_avg: &'static [u32],
    pub exp_avg_sq: &'static [u32],
    pub max_exp_avg_sq: Option<&'static [u32]>,
}

/// One Adagrad run and torch's result.
pub struct AdagradCase {
    pub lr: f64,
    pub lr_decay: f64,
    pub weight_decay: f64,
    pub initial_accumulator_value: f64,
    pub eps: f64,
    pub params: &'static [u32],
    pub sum: &'static [u32],
}

/// One RMSprop run and torch's result.
pub struct RmspropCase {
    pub lr: f64,
    pub alpha: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub centered: bool,
    pub params: &'static [u32],
    pub square_avg: &'static [u32],
    pub grad_avg: Option<&'static [u32]>,
    pub momentum_buffer: Option<&'static [u32]>,
}
"""


def main():
    torch.use_deterministic_algorithms(True)
    header = (
        f"// @generated by kernels.py with torch {torch.__version__}: do not edit;\n"
        "// rerun `python3 zero-nccl/tests/golden/kernels.py`.\n"
        "// Tensors are f32 bit patterns (f32::from_bits).\n"
        "#![allow(dead_code, clippy::unreadable_literal)]\n\n"
        f"pub const N: usize = {N};\n"
        f"pub const STEPS: usize = {STEPS};\n"
    )
    body = "\n".join([TYPES, sgd_cases(), sgd_midrun(), adam_cases(), adagrad_cases(), rmsprop_cases()])
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.rs")
    with open(path, "w") as f:
        f.write(header + body)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
