//! `zero_candle::nn` layers feeding today's `ZeroOptimizer::step(&GradStore)`
//! through a `GradCollector`: on two ranks at stage 2, training gives
//! exactly the weights of the same model built with candle-nn layers (the
//! old path: plain `backward()`, full gradients).

mod nn_support;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::sync::Arc;
use zero_candle::nn::{self, GradCollector, GradHook};
use zero_candle::ZeroOptimizer;
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::AdamWConfig;
use zero_core::{Communicator, ThreadGroup};

const VOCAB: usize = 9;
const DIM: usize = 6;
const HIDDEN: usize = 10;
const STEPS: usize = 3;

/// Ids of rank `rank`'s batch at `step`.
fn batch(step: usize, rank: usize) -> Tensor {
    let ids: Vec<u32> = (0..8)
        .map(|i| ((i * 5 + step * 3 + rank * 7) % VOCAB) as u32)
        .collect();
    Tensor::from_vec(ids, (2, 4), &Device::Cpu).unwrap()
}

/// Embedding, Linear, ReLU, Linear without bias; summed logits weighted by
/// a fixed pattern.
fn loss(layers: &[&dyn Module; 3], ids: &Tensor) -> Tensor {
    let h = layers[0].forward(ids).unwrap();
    let h = layers[1].forward(&h).unwrap().relu().unwrap();
    let logits = layers[2].forward(&h).unwrap();
    nn_support::weighted_sum(&logits, 3)
}

/// Seeded values for every variable, the same on every rank.
fn seed(varmap: &VarMap) {
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        var.set(&nn_support::data(100 + i as u64, var.dims(), DType::F32))
            .unwrap();
    }
}

fn weights(varmap: &VarMap) -> Vec<(String, Vec<f64>)> {
    let data = varmap.data().lock().unwrap();
    let mut named: Vec<(String, Vec<f64>)> = data
        .iter()
        .map(|(name, var)| (name.clone(), nn_support::values(var.as_tensor())))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

#[derive(Clone, Copy, PartialEq)]
enum Path {
    /// candle-nn layers, `opt.backward_step(&loss)`.
    CandleNn,
    /// Our layers with a `GradCollector`, merged into backward's `GradStore`.
    Collected,
    /// Our layers without a hook.
    Unhooked,
}

fn train(path: Path, steps: usize) -> Vec<Vec<(String, Vec<f64>)>> {
    let results = ThreadGroup::new(2).run(move |comm| {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let collector = Arc::new(GradCollector::new());
        let hook: Option<Arc<dyn GradHook>> = match path {
            Path::Collected => Some(collector.clone()),
            _ => None,
        };
        let layers: [Box<dyn Module>; 3] = match path {
            Path::CandleNn => [
                Box::new(candle_nn::embedding(VOCAB, DIM, vb.pp("emb")).unwrap()),
                Box::new(candle_nn::linear(DIM, HIDDEN, vb.pp("fc1")).unwrap()),
                Box::new(candle_nn::linear_no_bias(HIDDEN, VOCAB, vb.pp("fc2")).unwrap()),
            ],
            _ => [
                Box::new(nn::embedding(VOCAB, DIM, vb.pp("emb"), hook.clone()).unwrap()),
                Box::new(nn::linear(DIM, HIDDEN, vb.pp("fc1"), hook.clone()).unwrap()),
                Box::new(nn::linear_no_bias(HIDDEN, VOCAB, vb.pp("fc2"), hook.clone()).unwrap()),
            ],
        };
        seed(&varmap);
        let adamw = zero_core::optim::AdamW::new(AdamWConfig::default().with_lr(0.05)).unwrap();
        let config = EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_bucket_bytes(64);
        let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw)).unwrap();
        let layers = [&*layers[0], &*layers[1], &*layers[2]];
        for step in 0..steps {
            let loss = loss(&layers, &batch(step, rank));
            match path {
                Path::Collected => {
                    let mut grads = loss.backward().unwrap();
                    assert_eq!(grads.get_ids().count(), 1, "only the loss itself");
                    collector.merge_into(&mut grads).unwrap();
                    opt.step(&grads).unwrap();
                }
                _ => {
                    opt.backward_step(&loss).unwrap();
                }
            }
        }
        weights(&varmap)
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn collected_gradients_train_exactly_like_candle_nn_layers() {
    let reference = train(Path::CandleNn, STEPS);
    assert_eq!(reference[0], reference[1], "ranks agree");
    assert_ne!(train(Path::CandleNn, 0), reference, "the model trains");
    assert_eq!(train(Path::Collected, STEPS), reference);
    assert_eq!(train(Path::Unhooked, STEPS), reference);
}
