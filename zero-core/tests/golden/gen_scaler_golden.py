"""Golden values for zero-core/tests/engine_precision.rs (loss scaling),
computed by torch.amp.GradScaler.

Run from this directory:  python3 gen_scaler_golden.py  (writes scaler_golden.json)

Three data-parallel ranks are emulated in one process: at each step every
rank's gradient is the scale times a formula the Rust test reimplements
(multiples of 1/64, exact in f32), with an inf or a NaN planted in one
rank's gradient at chosen steps; the parameter's .grad is their mean (what
the engine's reduce-scatter/all-reduce with Avg gives), then
scaler.step(opt) and scaler.update(). growth_interval is 3 so that the run
shows growth as well as backoff. Recorded per step: the scale the
gradients were multiplied by, whether the step was skipped (GradScaler's own
found_inf), and at the end the scale and the weights.
"""

import json
import torch

STEPS = 16
WORLD = 3
PARAMS = [("a", 40), ("b", 30)]
# (step, rank, parameter index, element, value): planted non-finite values.
PLANTED = [
    (2, 1, 0, 3, float("inf")),
    (5, 1, 1, 29, float("-inf")),
    (6, 2, 0, 39, float("nan")),
    (11, 0, 1, 0, float("inf")),
]
LR = 0.01
MOMENTUM = 0.9


def grad(step, rank, p, i):
    return ((i % 7) + 1) * (rank + 1) * ((step % 5) + 1) / 64.0 - 0.5 + p * 0.125


def init(p, i):
    return (i % 11) * 0.25 - 1.0 + p * 0.5


def main():
    params = [
        torch.tensor([init(p, i) for i in range(n)], dtype=torch.float32, requires_grad=True)
        for p, (_, n) in enumerate(PARAMS)
    ]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, foreach=False)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3
    )
    scales, skipped = [], []
    for step in range(STEPS):
        # The loss would be multiplied here; the scaled value is what every
        # rank's gradient below carries (and it initializes the scaler).
        scaler.scale(torch.tensor(1.0))
        scale = scaler.get_scale()
        scales.append(scale)
        for p, (_, n) in enumerate(PARAMS):
            per_rank = []
            for rank in range(WORLD):
                g = torch.tensor(
                    [grad(step, rank, p, i) for i in range(n)], dtype=torch.float32
                ) * scale
                for s, r, q, i, v in PLANTED:
                    if (s, r, q) == (step, rank, p):
                        g[i] = v
                per_rank.append(g)
            params[p].grad = torch.stack(per_rank).mean(0)
        scaler.step(opt)
        state = scaler._per_optimizer_states[id(opt)]
        found = sum(v.item() for v in state["found_inf_per_device"].values())
        skipped.append(found > 0)
        scaler.update()
    out = {
        "steps": STEPS,
        "world": WORLD,
        "params": [[name, n] for name, n in PARAMS],
        "planted": [[s, r, q, i, str(v)] for s, r, q, i, v in PLANTED],
        "lr": LR,
        "momentum": MOMENTUM,
        "scales": scales,
        "skipped": skipped,
        "final_scale": scaler.get_scale(),
        "weights": [p.detach().tolist() for p in params],
    }
    with open("scaler_golden.json", "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
