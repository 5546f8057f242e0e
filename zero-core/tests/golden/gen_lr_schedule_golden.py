"""Golden values for zero-core/tests/lr_schedule_golden.rs, computed by
transformers' learning-rate schedules on a torch optimizer.

Run from this directory:  python3 gen_lr_schedule_golden.py
(writes lr_schedule_golden.json)

Each case builds a transformers schedule (a torch LambdaLR) over an SGD
optimizer and records the learning rate of every optimizer step, stepping the
schedule after the optimizer as a training loop does, so entry `step` is the
rate of the optimizer step `step` (from 0). The linear decay to a floor has no
transformers function: its case applies the floor the way
get_cosine_with_min_lr_schedule_with_warmup applies it to the cosine
(factor * (1 - min_lr / lr) + min_lr / lr), through LambdaLR.
"""

import json
from functools import partial

import torch
import transformers
from torch.optim.lr_scheduler import LambdaLR
from transformers.optimization import (
    _get_linear_schedule_with_warmup_lr_lambda,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)


def linear_with_min_lr(optimizer, num_warmup_steps, num_training_steps, min_lr):
    """Linear decay to min_lr, the floor applied as transformers' cosine does."""
    rate = min_lr / optimizer.defaults["lr"]
    linear = partial(
        _get_linear_schedule_with_warmup_lr_lambda,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
    )

    def lr_lambda(step):
        if step < num_warmup_steps:
            return linear(step)
        return max(0.0, linear(step) * (1 - rate) + rate)

    return LambdaLR(optimizer, lr_lambda)


# (name, decay, lr, warmup, total, min_lr, steps recorded, make schedule)
CASES = [
    ("cosine_warmup", "cosine", 3e-4, 10, 100, 0.0, 101,
     lambda o: get_cosine_schedule_with_warmup(o, 10, 100)),
    ("cosine_warmup_min_lr", "cosine", 3e-4, 10, 100, 3e-5, 101,
     lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 10, 100, min_lr=3e-5)),
    ("cosine_no_warmup_min_lr", "cosine", 6e-4, 0, 37, 6e-5, 38,
     lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 0, 37, min_lr=6e-5)),
    # transformers' linear decay clamps at 0, the floor, past its end.
    ("linear_warmup", "linear", 1e-3, 7, 50, 0.0, 80,
     lambda o: get_linear_schedule_with_warmup(o, 7, 50)),
    ("linear_warmup_min_lr", "linear", 1e-3, 7, 50, 2.5e-4, 80,
     lambda o: linear_with_min_lr(o, 7, 50, 2.5e-4)),
    ("constant_warmup", "constant", 5e-3, 13, None, None, 40,
     lambda o: get_constant_schedule_with_warmup(o, 13)),
]


def rates(lr, steps, make):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    schedule = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return out


cases = [
    {
        "name": name,
        "decay": decay,
        "lr": lr,
        "warmup_steps": warmup,
        "total_steps": total,
        "min_lr": min_lr,
        "rates": rates(lr, steps, make),
    }
    for name, decay, lr, warmup, total, min_lr, steps, make in CASES
]
golden = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "cases": cases,
}
with open("lr_schedule_golden.json", "w") as f:
    json.dump(golden, f, indent=1)
    f.write("\n")
