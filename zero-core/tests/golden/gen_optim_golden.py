"""Golden values for zero-core/tests/optim_golden.rs, computed by torch.optim.

Run from this directory:  python3 gen_optim_golden.py  (writes optim_golden.json)

Every case steps three parameters for STEPS steps with the single-tensor
("foreach=False") implementations, in float64 and float32. Initial values and
gradients come from a 32-bit LCG that the Rust test reimplements, so only
hyperparameters and results are stored. Some gradients are None (p.grad = None)
so that parameters' step counts differ, and the learning rate of every group
is halved after step LR_CHANGE_STEP, as a scheduler would.
"""

import json
import torch

STEPS = 12
LR_CHANGE_STEP = 6
LR_FACTOR = 0.5
PARAMS = [("a", 12), ("b", 5), ("c", 9)]
# (step, parameter index) pairs whose gradient is None.
NONE = [(2, 1), (5, 1), (6, 1), (0, 2), (9, 2)]


def lcg_values(seed, n):
    """n values in [-2, 2], exactly representable computations in f64."""
    x = seed & 0xFFFFFFFF
    out = []
    for _ in range(n):
        x = (1664525 * x + 1013904223) & 0xFFFFFFFF
        out.append(((x >> 8) % 20001 - 10000) / 5000.0)
    return out


def init_seed(i):
    return 1000 + i


def grad_seed(step, i):
    return 7919 * step + 31 * i + 1


CLASSES = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}

# name, optimizer, group hyperparameters, group of each parameter
CASES = [
    ("sgd_plain", "sgd", [{"lr": 0.1}], [0, 0, 0]),
    ("sgd_momentum", "sgd", [{"lr": 0.1, "momentum": 0.9}], [0, 0, 0]),
    ("sgd_dampening", "sgd", [{"lr": 0.1, "momentum": 0.9, "dampening": 0.3}], [0, 0, 0]),
    ("sgd_nesterov", "sgd", [{"lr": 0.1, "momentum": 0.9, "nesterov": True}], [0, 0, 0]),
    ("sgd_weight_decay", "sgd", [{"lr": 0.1, "weight_decay": 0.05}], [0, 0, 0]),
    ("sgd_maximize", "sgd", [{"lr": 0.1, "maximize": True}], [0, 0, 0]),
    ("sgd_combo", "sgd",
     [{"lr": 0.05, "momentum": 0.8, "dampening": 0.1, "weight_decay": 0.02, "maximize": True}], [0, 0, 0]),
    ("sgd_groups", "sgd",
     [{"lr": 0.1, "momentum": 0.9},
      {"lr": 0.03, "momentum": 0.5, "nesterov": True, "weight_decay": 0.1}], [0, 1, 1]),
    ("adam_default", "adam", [{"lr": 0.01}], [0, 0, 0]),
    ("adam_weight_decay", "adam", [{"lr": 0.01, "weight_decay": 0.1}], [0, 0, 0]),
    ("adam_amsgrad", "adam", [{"lr": 0.01, "amsgrad": True}], [0, 0, 0]),
    ("adam_maximize", "adam", [{"lr": 0.01, "maximize": True}], [0, 0, 0]),
    ("adam_combo", "adam",
     [{"lr": 0.02, "weight_decay": 0.05, "amsgrad": True, "maximize": True, "eps": 1e-6}], [0, 0, 0]),
    ("adam_small_betas", "adam", [{"lr": 0.01, "betas": [0.3, 0.5]}], [0, 0, 0]),
    ("adam_groups", "adam",
     [{"lr": 0.01}, {"lr": 0.005, "betas": [0.8, 0.99], "weight_decay": 0.01, "amsgrad": True}], [1, 0, 1]),
    ("adamw_default", "adamw", [{"lr": 0.01}], [0, 0, 0]),
    ("adamw_weight_decay", "adamw", [{"lr": 0.01, "weight_decay": 0.1}], [0, 0, 0]),
    ("adamw_no_decay", "adamw", [{"lr": 0.01, "weight_decay": 0.0}], [0, 0, 0]),
    ("adamw_amsgrad", "adamw", [{"lr": 0.01, "amsgrad": True}], [0, 0, 0]),
    ("adamw_maximize", "adamw", [{"lr": 0.01, "maximize": True}], [0, 0, 0]),
    ("adamw_combo", "adamw",
     [{"lr": 0.02, "weight_decay": 0.2, "amsgrad": True, "maximize": True, "betas": [0.3, 0.5]}], [0, 0, 0]),
    ("adamw_groups", "adamw",
     [{"lr": 0.01, "weight_decay": 0.0}, {"lr": 0.01, "weight_decay": 0.01}], [0, 1, 0]),
    ("adagrad_default", "adagrad", [{"lr": 0.1}], [0, 0, 0]),
    ("adagrad_lr_decay", "adagrad", [{"lr": 0.1, "lr_decay": 0.05}], [0, 0, 0]),
    ("adagrad_weight_decay", "adagrad", [{"lr": 0.1, "weight_decay": 0.1}], [0, 0, 0]),
    ("adagrad_initial_accumulator", "adagrad", [{"lr": 0.1, "initial_accumulator_value": 0.5}], [0, 0, 0]),
    ("adagrad_combo", "adagrad",
     [{"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.05, "initial_accumulator_value": 0.1,
       "eps": 1e-6, "maximize": True}], [0, 0, 0]),
    ("rmsprop_default", "rmsprop", [{"lr": 0.01}], [0, 0, 0]),
    ("rmsprop_centered", "rmsprop", [{"lr": 0.01, "centered": True}], [0, 0, 0]),
    ("rmsprop_momentum", "rmsprop", [{"lr": 0.01, "momentum": 0.9}], [0, 0, 0]),
    ("rmsprop_weight_decay", "rmsprop", [{"lr": 0.01, "weight_decay": 0.1}], [0, 0, 0]),
    ("rmsprop_combo", "rmsprop",
     [{"lr": 0.01, "centered": True, "momentum": 0.5, "weight_decay": 0.05, "maximize": True}], [0, 0, 0]),
    ("rmsprop_small_alpha", "rmsprop", [{"lr": 0.01, "alpha": 0.3, "centered": True}], [0, 0, 0]),
    ("rmsprop_groups", "rmsprop",
     [{"lr": 0.01, "momentum": 0.9}, {"lr": 0.02, "centered": True}], [1, 1, 0]),
]


def run(kind, groups, assignment, dtype):
    params = [
        torch.tensor(lcg_values(init_seed(i), n), dtype=dtype, requires_grad=True)
        for i, (_, n) in enumerate(PARAMS)
    ]
    param_groups = [
        dict(h, params=[p for p, g in zip(params, assignment) if g == k])
        for k, h in enumerate(groups)
    ]
    # Group 0's values are also given to the constructor: torch.optim.Adagrad
    # fills `sum` with the constructor's initial_accumulator_value, ignoring
    # the group's (zero-core uses the group's).
    opt = CLASSES[kind](param_groups, foreach=False, **groups[0])
    for step in range(STEPS):
        if step == LR_CHANGE_STEP:
            for group in opt.param_groups:
                group["lr"] *= LR_FACTOR
        for i, (p, (_, n)) in enumerate(zip(params, PARAMS)):
            if (step, i) in NONE:
                p.grad = None
            else:
                p.grad = torch.tensor(lcg_values(grad_seed(step, i), n), dtype=dtype)
        opt.step()
    state = []
    for p in params:
        s = opt.state.get(p, {})
        entry = {"scalars": {}, "tensors": {}}
        for key, value in s.items():
            if value is None:
                continue
            if key == "step":
                entry["scalars"]["step"] = float(value)
            else:
                entry["tensors"][key] = [float(x) for x in value.detach().tolist()]
        state.append(entry)
    return {
        "params": [[float(x) for x in p.detach().tolist()] for p in params],
        "state": state,
    }


def main():
    torch.set_num_threads(1)
    cases = []
    for name, kind, groups, assignment in CASES:
        cases.append({
            "name": name,
            "optimizer": kind,
            "groups": groups,
            "assignment": assignment,
            "f64": run(kind, groups, assignment, torch.float64),
            "f32": run(kind, groups, assignment, torch.float32),
        })
    out = {
        "torch_version": torch.__version__,
        "steps": STEPS,
        "lr_change_step": LR_CHANGE_STEP,
        "lr_factor": LR_FACTOR,
        "params": [{"name": n, "len": l} for n, l in PARAMS],
        "none": [list(x) for x in NONE],
        "cases": cases,
    }
    with open("optim_golden.json", "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
