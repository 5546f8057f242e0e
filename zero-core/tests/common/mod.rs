//! Shared pieces of the engine tests: models with hand-written gradients,
//! the DDP reference (mean of the ranks' full gradients, then an unsharded
//! optimizer with whole-parameter keys) and helpers to run ranks.
#![allow(dead_code)]

pub mod lion;
mod plan_check;
#[allow(unused_imports)]
pub use plan_check::{PlanCheck, Seen};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use zero_core::engine::{Engine, EngineConfig};
use zero_core::engine::{GatherMemory, HostGrad, HostMemory, OffloadMemory, ShardMemory};
use zero_core::optim::{
    Adam, AdamConfig, AdamW, AdamWConfig, Hyperparams, ParamKey, ParamMut, Sgd, SgdConfig,
};
use zero_core::{
    DType, FunctionalOptimizer, ParamInfo, ParamStore, Result, ThreadComm, ThreadGroup,
};

/// A model: parameters (sorted by name), their initial values, and
/// deterministic per-rank, per-step gradients at given parameter values.
pub trait Model: Sync {
    fn infos(&self) -> Vec<ParamInfo>;
    fn init(&self) -> Vec<Vec<f64>>;
    fn grads(&self, params: &[Vec<f64>], rank: usize, step: usize) -> Vec<Vec<f64>>;
}

fn rng(seed: u64, a: usize, b: usize, c: usize) -> StdRng {
    StdRng::seed_from_u64(
        seed ^ ((a as u64) << 48) ^ ((b as u64) << 24) ^ (c as u64).wrapping_mul(0x9e37_79b9),
    )
}

/// An MLP `dims[0] -> dims[1] -> ... -> dims.last()` with tanh hidden
/// layers and a linear output; loss = mean over the batch of `sum |out|`.
/// Parameters `l{k}.bias` (out) and `l{k}.weight` (out x in, row-major).
pub struct Mlp {
    pub dims: Vec<usize>,
    pub batch: usize,
    pub seed: u64,
}

impl Mlp {
    pub fn new(dims: &[usize]) -> Self {
        Self {
            dims: dims.to_vec(),
            batch: 8,
            seed: 7,
        }
    }

    /// The batch of rank `rank` at step `step`, `batch x dims[0]`.
    pub fn data(&self, rank: usize, step: usize) -> Vec<f64> {
        let mut r = rng(self.seed, 1 + rank, step, 0);
        (0..self.batch * self.dims[0])
            .map(|_| r.gen_range(-1.0..1.0))
            .collect()
    }

    /// Loss and gradients on `x` (`batch x dims[0]`).
    pub fn loss_and_grads(&self, params: &[Vec<f64>], x: &[f64]) -> (f64, Vec<Vec<f64>>) {
        let layers = self.dims.len() - 1;
        let b = self.batch;
        // acts[k] is the input of layer k (b x dims[k]).
        let mut acts = vec![x.to_vec()];
        for k in 0..layers {
            let (n_in, n_out) = (self.dims[k], self.dims[k + 1]);
            let (bias, w) = (&params[2 * k], &params[2 * k + 1]);
            let input = &acts[k];
            let mut out = vec![0.0; b * n_out];
            for s in 0..b {
                for o in 0..n_out {
                    let mut z = bias[o];
                    for i in 0..n_in {
                        z += w[o * n_in + i] * input[s * n_in + i];
                    }
                    out[s * n_out + o] = if k + 1 < layers { z.tanh() } else { z };
                }
            }
            acts.push(out);
        }
        let out = &acts[layers];
        let loss = out.iter().map(|v| v.abs()).sum::<f64>() / b as f64;
        let mut delta: Vec<f64> = out.iter().map(|v| v.signum() / b as f64).collect();
        let mut grads = vec![Vec::new(); 2 * layers];
        for k in (0..layers).rev() {
            let (n_in, n_out) = (self.dims[k], self.dims[k + 1]);
            let input = &acts[k];
            let mut gb = vec![0.0; n_out];
            let mut gw = vec![0.0; n_out * n_in];
            for s in 0..b {
                for o in 0..n_out {
                    let d = delta[s * n_out + o];
                    gb[o] += d;
                    for i in 0..n_in {
                        gw[o * n_in + i] += d * input[s * n_in + i];
                    }
                }
            }
            if k > 0 {
                let w = &params[2 * k + 1];
                let mut prev = vec![0.0; b * n_in];
                for s in 0..b {
                    for i in 0..n_in {
                        let mut d = 0.0;
                        for o in 0..n_out {
                            d += delta[s * n_out + o] * w[o * n_in + i];
                        }
                        let h = input[s * n_in + i];
                        prev[s * n_in + i] = d * (1.0 - h * h);
                    }
                }
                delta = prev;
            }
            grads[2 * k] = gb;
            grads[2 * k + 1] = gw;
        }
        (loss, grads)
    }
}

impl Model for Mlp {
    fn infos(&self) -> Vec<ParamInfo> {
        let mut out = Vec::new();
        for k in 0..self.dims.len() - 1 {
            out.push(ParamInfo::new(
                format!("l{k}.bias"),
                [self.dims[k + 1]],
                DType::F64,
            ));
            out.push(ParamInfo::new(
                format!("l{k}.weight"),
                [self.dims[k + 1], self.dims[k]],
                DType::F64,
            ));
        }
        out
    }

    fn init(&self) -> Vec<Vec<f64>> {
        self.infos()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut r = rng(self.seed, 0, 0, 1000 + i);
                let scale = 1.0 / (p.shape.last().copied().unwrap_or(1) as f64).sqrt();
                (0..p.numel()).map(|_| r.gen_range(-scale..scale)).collect()
            })
            .collect()
    }

    fn grads(&self, params: &[Vec<f64>], rank: usize, step: usize) -> Vec<Vec<f64>> {
        self.loss_and_grads(params, &self.data(rank, step)).1
    }
}

/// Synthetic gradients `g = a_r * p + b_{r,step}` (element-wise, seeded),
/// enough to exercise sharding, communication and optimizer logic.
pub struct Synthetic {
    pub shapes: Vec<(String, Vec<usize>)>,
    pub seed: u64,
}

impl Synthetic {
    pub fn new(shapes: &[(&str, &[usize])]) -> Self {
        let mut shapes: Vec<(String, Vec<usize>)> = shapes
            .iter()
            .map(|(n, s)| (n.to_string(), s.to_vec()))
            .collect();
        shapes.sort();
        Self { shapes, seed: 11 }
    }

    /// Shapes with a few hundred elements: several tiny buckets per rank.
    pub fn medium() -> Self {
        Self::new(&[
            ("a.weight", &[40, 3]),
            ("a.bias", &[7]),
            ("b.weight", &[50, 2]),
            ("b.bias", &[13]),
            ("c.weight", &[3, 3]),
        ])
    }
}

impl Model for Synthetic {
    fn infos(&self) -> Vec<ParamInfo> {
        self.shapes
            .iter()
            .map(|(n, s)| ParamInfo::new(n.clone(), s.clone(), DType::F64))
            .collect()
    }

    fn init(&self) -> Vec<Vec<f64>> {
        self.infos()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut r = rng(self.seed, 0, 0, 1000 + i);
                (0..p.numel()).map(|_| r.gen_range(-1.0..1.0)).collect()
            })
            .collect()
    }

    fn grads(&self, params: &[Vec<f64>], rank: usize, step: usize) -> Vec<Vec<f64>> {
        params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut ra = rng(self.seed, 1 + rank, 0, i);
                let mut rb = rng(self.seed, 1 + rank, 1 + step, i);
                p.iter()
                    .map(|&x| ra.gen_range(0.5..1.5) * x + rb.gen_range(-1.0..1.0))
                    .collect()
            })
            .collect()
    }
}

/// The built-in optimizers under test.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Opt {
    Sgd,
    Adam,
    AdamW,
}

pub fn make_opt(opt: Opt, maximize: bool) -> Box<dyn FunctionalOptimizer<f64>> {
    match opt {
        Opt::Sgd => Box::new(
            Sgd::<f64>::new(
                SgdConfig::default()
                    .with_lr(0.05)
                    .with_momentum(0.9)
                    .with_maximize(maximize),
            )
            .unwrap(),
        ),
        Opt::Adam => Box::new(
            Adam::<f64>::new(
                AdamConfig::default()
                    .with_lr(0.01)
                    .with_weight_decay(0.001)
                    .with_maximize(maximize),
            )
            .unwrap(),
        ),
        Opt::AdamW => Box::new(
            AdamW::<f64>::new(AdamWConfig::default().with_lr(0.01).with_maximize(maximize))
                .unwrap(),
        ),
    }
}

pub fn weight_decay(wd: f64) -> Hyperparams {
    let serde_json::Value::Object(map) = json!({ "weight_decay": wd }) else {
        unreachable!()
    };
    map
}

/// Mean over ranks of their full gradients, summed in rank order and divided
/// by the world size, as the thread backend's `Avg` does.
pub fn mean(per_rank: &[Vec<Vec<f64>>]) -> Vec<Vec<f64>> {
    let n = per_rank.len() as f64;
    let mut out = per_rank[0].clone();
    for g in &per_rank[1..] {
        for (o, x) in out.iter_mut().zip(g) {
            for (a, b) in o.iter_mut().zip(x) {
                *a += *b;
            }
        }
    }
    for o in &mut out {
        for a in o.iter_mut() {
            *a /= n;
        }
    }
    out
}

/// DDP-ref: one unsharded optimizer stepping whole parameters.
pub struct Reference {
    pub opt: Box<dyn FunctionalOptimizer<f64>>,
    pub infos: Vec<ParamInfo>,
    pub params: Vec<Vec<f64>>,
    pub groups: Vec<usize>,
}

impl Reference {
    pub fn new(model: &dyn Model, opt: Box<dyn FunctionalOptimizer<f64>>) -> Self {
        let infos = model.infos();
        Self {
            groups: vec![0; infos.len()],
            params: model.init(),
            infos,
            opt,
        }
    }

    /// Steps with already-reduced gradients; `None` leaves a parameter be.
    pub fn step(&mut self, grads: &[Option<Vec<f64>>]) {
        let keys: Vec<ParamKey> = self
            .infos
            .iter()
            .zip(&self.groups)
            .map(|(p, &g)| ParamKey::new(p.name.clone(), 0, g))
            .collect();
        let mut pieces: Vec<ParamMut<'_, f64>> = keys
            .iter()
            .zip(self.params.iter_mut())
            .map(|(key, data)| ParamMut {
                key,
                data: data.as_mut_slice(),
            })
            .collect();
        let grads: Vec<Option<&[f64]>> = grads.iter().map(|g| g.as_deref()).collect();
        self.opt.step(&mut pieces, &grads).unwrap();
    }

    /// Gradients of every rank at the current parameters.
    pub fn rank_grads(&self, model: &dyn Model, world: usize, step: usize) -> Vec<Vec<Vec<f64>>> {
        (0..world)
            .map(|r| model.grads(&self.params, r, step))
            .collect()
    }
}

/// Runs `f` on `world` ranks and unwraps every rank's result.
pub fn run<R: Send>(world: usize, f: impl Fn(ThreadComm) -> Result<R> + Sync) -> Vec<R> {
    ThreadGroup::new(world)
        .with_timeout(std::time::Duration::from_secs(60))
        .run(f)
        .into_iter()
        .enumerate()
        .map(|(rank, r)| match r {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("rank {rank} failed: {e}"),
            Err(e) => panic!("rank {rank}: {e}"),
        })
        .collect()
}

/// Builds an engine for `model` on `comm`.
pub fn engine(
    comm: ThreadComm,
    model: &dyn Model,
    opt: Box<dyn FunctionalOptimizer<f64>>,
    config: EngineConfig,
) -> Result<Engine<f64, ThreadComm>> {
    Engine::new(comm, model.infos(), opt, config)
}

/// Borrows owned gradients as engine slots.
pub fn slots(grads: &[Vec<f64>]) -> Vec<Option<HostGrad<'_, f64>>> {
    grads.iter().map(|g| Some(g.into())).collect()
}

/// Asserts `a` and `b` agree element-wise within `atol`.
#[track_caller]
/// Every rank's trajectory (parameters after each step) within `atol` of
/// `expected`.
pub fn assert_trajectories(
    trajectories: &[Vec<Vec<Vec<f64>>>],
    expected: &[Vec<Vec<f64>>],
    atol: f64,
    what: &str,
) {
    for t in trajectories {
        for (s, want) in expected.iter().enumerate() {
            assert_close(&t[s], want, atol, &format!("{what} step {s}"));
        }
    }
}

pub fn assert_close(a: &[Vec<f64>], b: &[Vec<f64>], atol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: parameter count");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: parameter {i} length");
        for (e, (u, v)) in x.iter().zip(y).enumerate() {
            assert!(
                (u - v).abs() <= atol,
                "{what}: parameter {i} element {e}: {u} vs {v} (diff {})",
                (u - v).abs()
            );
        }
    }
}

/// DDP-ref of one large batch: per step, the mean over ranks of the mean of
/// `micro` micro-batch gradients (micro-batch `m` of step `s` is data index
/// `s * micro + m`).
pub fn reference_trajectory(
    model: &dyn Model,
    opt: Opt,
    world: usize,
    micro: usize,
    steps: usize,
) -> Vec<Vec<Vec<f64>>> {
    let mut reference = Reference::new(model, make_opt(opt, false));
    let mut out = Vec::new();
    for s in 0..steps {
        let per_rank: Vec<Vec<Vec<f64>>> = (0..world)
            .map(|r| {
                let micros: Vec<Vec<Vec<f64>>> = (0..micro)
                    .map(|m| model.grads(&reference.params, r, s * micro + m))
                    .collect();
                mean(&micros)
            })
            .collect();
        let g = mean(&per_rank);
        reference.step(&g.into_iter().map(Some).collect::<Vec<_>>());
        out.push(reference.params.clone());
    }
    out
}

/// Names of the files in `dir`, sorted.
pub fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The path and detail of a checkpoint error (any other error panics).
pub fn ckpt_err(err: zero_core::Error) -> (std::path::PathBuf, String) {
    match err {
        zero_core::Error::Checkpoint { path, detail } => (path, detail),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

/// One micro-step whose gradients `grads` are handed over during
/// "backward": `begin_backward` with the reverse parameter order, each
/// gradient in that order (as backward produces them), then the step,
/// which ends the pass.
pub fn hooked_micro_step<C, M>(
    e: &mut Engine<f64, C, M>,
    grads: &[Vec<f64>],
    params: &mut Vec<Vec<f64>>,
) -> Result<()>
where
    C: zero_core::Communicator,
    M: for<'g, 'p> zero_core::engine::ShardMemory<
        f64,
        C,
        Grad<'g> = HostGrad<'g, f64>,
        Params<'p> = dyn zero_core::ParamStore<f64> + 'p,
    >,
{
    let n = grads.len();
    let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
    e.begin_backward(&order, params)?;
    for p in (0..n).rev() {
        e.accumulate_param(p, .., (&grads[p]).into())?;
    }
    let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
    e.step(&none, params)?;
    Ok(())
}

/// An engine memory over host buffers, as the tests drive it.
pub trait TestMemory:
    for<'g, 'p> ShardMemory<
    f64,
    ThreadComm,
    Grad<'g> = HostGrad<'g, f64>,
    Params<'p> = dyn ParamStore<f64> + 'p,
    Gathers = Self::G,
>
{
    type G: GatherMemory<f64, Buffer = zero_core::engine::HostGather<f64>>;
}

impl TestMemory for HostMemory {
    type G = Self::Gathers;
}

impl TestMemory for OffloadMemory<HostMemory> {
    type G = Self::Gathers;
}

impl TestMemory for OffloadMemory<PlanCheck> {
    type G = Self::Gathers;
}
