//! The hook's contract, on models made of several `zero_candle::nn` layers:
//! the order of its calls is the order of the variables in
//! `loss.sorted_nodes()`, a tied weight gets the sum of its uses, an unused
//! layer is never reported, errors come out of `backward()`, and
//! `GradCollector` turns the calls into a `GradStore`.

mod nn_support;

use candle_core::{DType, Device, Module, Tensor, TensorId, Var};
use candle_nn::{VarBuilder, VarMap};
use nn_support::{assert_close, assert_equal, hook, weighted_sum, Recorder};
use std::collections::HashSet;
use std::sync::Arc;
use zero_candle::nn::{self, GradCollector, GradHook};

const VOCAB: usize = 13;
const DIM: usize = 8;
const HIDDEN: usize = 12;
const EPS: f64 = 1e-5;

fn ids() -> Tensor {
    Tensor::new(&[[1u32, 4, 4, 12], [0, 7, 1, 3]], &Device::Cpu).unwrap()
}

/// A small language-model-shaped network with every kind of layer and two
/// tapped parameters.
struct Net {
    emb: nn::Embedding,
    pos: Var,
    ln: nn::LayerNorm,
    fc1: nn::Linear,
    rms: nn::RmsNorm,
    fc2: nn::Linear,
    scale: Var,
    hook: Option<Arc<dyn GradHook>>,
}

impl Net {
    fn new(vb: VarBuilder, hook: Option<Arc<dyn GradHook>>) -> Self {
        let var = |t: Tensor| Var::from_tensor(&t).unwrap();
        Self {
            emb: nn::embedding(VOCAB, DIM, vb.pp("emb"), hook.clone()).unwrap(),
            pos: var(vb.get((4, DIM), "pos").unwrap()),
            ln: nn::layer_norm(DIM, EPS, vb.pp("ln"), hook.clone()).unwrap(),
            fc1: nn::linear(DIM, HIDDEN, vb.pp("fc1"), hook.clone()).unwrap(),
            rms: nn::rms_norm(HIDDEN, EPS, vb.pp("rms"), hook.clone()).unwrap(),
            fc2: nn::linear_no_bias(HIDDEN, VOCAB, vb.pp("fc2"), hook.clone()).unwrap(),
            scale: var(vb.get(VOCAB, "scale").unwrap()),
            hook,
        }
    }

    fn loss(&self, ids: &Tensor) -> Tensor {
        let pos = nn::tap(&self.pos, self.hook.clone()).unwrap();
        let h = self.emb.forward(ids).unwrap().broadcast_add(&pos).unwrap();
        let h = self.ln.forward(&h).unwrap();
        let h = self.fc1.forward(&h).unwrap().relu().unwrap();
        let h = self.rms.forward(&h).unwrap();
        let logits = self.fc2.forward(&h).unwrap();
        let scale = nn::tap(&self.scale, self.hook.clone()).unwrap();
        weighted_sum(&logits.broadcast_mul(&scale).unwrap(), 99)
    }

    fn params(&self) -> Vec<Tensor> {
        let mut params = vec![
            self.emb.embeddings().clone(),
            self.pos.as_tensor().clone(),
            self.ln.weight().clone(),
            self.ln.bias().unwrap().clone(),
            self.fc1.weight().clone(),
            self.fc1.bias().unwrap().clone(),
            self.rms.weight().clone(),
            self.fc2.weight().clone(),
            self.scale.as_tensor().clone(),
        ];
        params.dedup_by_key(|t| t.id());
        params
    }
}

#[test]
fn calls_come_in_the_order_of_the_variables_in_sorted_nodes() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let recorder = Recorder::new();
    let net = Net::new(vb, hook(&recorder));
    let loss = net.loss(&ids());
    let params: HashSet<TensorId> = net.params().iter().map(|p| p.id()).collect();
    // Known before backward runs: what the engine builds its buckets from.
    let predicted: Vec<TensorId> = loss
        .sorted_nodes()
        .into_iter()
        .filter(|node| node.is_variable() && params.contains(&node.id()))
        .map(|node| node.id())
        .collect();
    assert_eq!(predicted.len(), 9);
    let grads = loss.backward().unwrap();
    assert_eq!(recorder.ids(), predicted);
    for param in net.params() {
        assert!(
            grads.get(&param).is_none(),
            "hooked gradients skip the GradStore"
        );
    }
}

#[test]
fn hooked_gradients_equal_the_unhooked_grad_store() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let collector = Arc::new(GradCollector::new());
    let hooked = Net::new(vb.clone(), Some(collector.clone()));
    let plain = Net::new(vb, None);
    let want = plain.loss(&ids()).backward().unwrap();
    let mut got = hooked.loss(&ids()).backward().unwrap();
    assert_eq!(collector.len(), 9);
    collector.merge_into(&mut got).unwrap();
    assert!(collector.is_empty());
    for param in plain.params() {
        assert_equal(
            "gradient",
            got.get(&param).unwrap(),
            want.get(&param).unwrap(),
        );
    }
}

/// The embedding table reused as the output projection, three ways (our
/// fused Linear, candle-nn's Linear over a tap, candle-nn's Linear over the
/// variable itself); each must give candle-nn's gradient for the table (the
/// sum of both uses).
#[test]
fn a_tied_weight_gets_the_sum_of_its_uses() {
    #[derive(Debug, Clone, Copy)]
    enum Tie {
        FusedLinear,
        Tap,
        PlainMatmul,
    }
    for tie in [Tie::FusedLinear, Tie::Tap, Tie::PlainMatmul] {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let reference = candle_nn::embedding(VOCAB, DIM, vb.pp("emb")).unwrap();
        let table = reference.embeddings().clone();
        let want = {
            let h = reference.forward(&ids()).unwrap();
            let logits = candle_nn::Linear::new(table.clone(), None)
                .forward(&h)
                .unwrap();
            weighted_sum(&logits, 5).backward().unwrap()
        };

        let recorder = Recorder::new();
        let collector = Arc::new(GradCollector::new());
        let both: Arc<dyn GradHook> = {
            let (recorder, collector) = (recorder.clone(), collector.clone());
            Arc::new(move |var: &Var, grad: Tensor| {
                recorder.grad_ready(var, grad.clone())?;
                collector.grad_ready(var, grad)
            })
        };
        let emb = nn::embedding(VOCAB, DIM, vb.pp("emb"), Some(both.clone())).unwrap();
        let h = emb.forward(&ids()).unwrap();
        let logits = match tie {
            Tie::FusedLinear => nn::Linear::new(table.clone(), None, Some(both.clone()))
                .forward(&h)
                .unwrap(),
            Tie::Tap => {
                let tied = nn::tap(&Var::from_tensor(&table).unwrap(), Some(both.clone())).unwrap();
                candle_nn::Linear::new(tied, None).forward(&h).unwrap()
            }
            Tie::PlainMatmul => candle_nn::Linear::new(table.clone(), None)
                .forward(&h)
                .unwrap(),
        };
        let mut got = weighted_sum(&logits, 5).backward().unwrap();
        let calls = recorder.grads_of(&table).len();
        match tie {
            Tie::PlainMatmul => {
                assert_eq!(calls, 1, "{tie:?}: the embedding's share");
                assert!(got.get(&table).is_some(), "{tie:?}: the matmul's share");
            }
            _ => {
                assert_eq!(calls, 2, "{tie:?}: one call per use");
                assert!(got.get(&table).is_none(), "{tie:?}");
            }
        }
        collector.merge_into(&mut got).unwrap();
        // Candle's index_add adds the embedding's rows one at a time into
        // the projection's share; here the embedding's share is summed
        // first, then added: the same sum, associated differently.
        assert_close(
            &format!("{tie:?} tied ∂table"),
            got.get(&table).unwrap(),
            want.get(&table).unwrap(),
            1e-6,
        );
    }
}

#[test]
fn a_layer_outside_the_loss_is_never_reported() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let recorder = Recorder::new();
    let used = nn::linear(DIM, HIDDEN, vb.pp("used"), hook(&recorder)).unwrap();
    let never_called = nn::linear(DIM, HIDDEN, vb.pp("never_called"), hook(&recorder)).unwrap();
    let dead_branch = nn::layer_norm(HIDDEN, EPS, vb.pp("dead_branch"), hook(&recorder)).unwrap();
    let x = Tensor::ones((3, DIM), DType::F32, &Device::Cpu).unwrap();
    let h = used.forward(&x).unwrap();
    let _discarded = dead_branch.forward(&h).unwrap();
    weighted_sum(&h, 1).backward().unwrap();
    let reported: HashSet<TensorId> = recorder.ids().into_iter().collect();
    let expected: HashSet<TensorId> = [used.weight().id(), used.bias().unwrap().id()].into();
    assert_eq!(reported, expected);
    assert_eq!(recorder.calls().len(), 2);
    let _ = never_called;
}

#[test]
fn a_hook_error_comes_out_of_backward() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let failing: Arc<dyn GradHook> = Arc::new(|_: &Var, _: Tensor| {
        candle_core::bail!("bucket 3 cannot be launched: the communicator is closed")
    });
    let layer = nn::linear(DIM, HIDDEN, vb.pp("fc"), Some(failing)).unwrap();
    let x = Tensor::ones((3, DIM), DType::F32, &Device::Cpu).unwrap();
    let err = weighted_sum(&layer.forward(&x).unwrap(), 1)
        .backward()
        .unwrap_err()
        .to_string();
    assert!(err.contains("communicator is closed"), "{err}");
}

#[test]
fn the_collector_takes_its_gradients_out_as_a_grad_store() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let collector = Arc::new(GradCollector::new());
    let layer = nn::linear(DIM, HIDDEN, vb.pp("fc"), Some(collector.clone())).unwrap();
    let x = Tensor::ones((3, DIM), DType::F32, &Device::Cpu).unwrap();
    weighted_sum(&layer.forward(&x).unwrap(), 1)
        .backward()
        .unwrap();
    let weight = Var::from_tensor(layer.weight()).unwrap();
    let weight_grad = collector.get(&weight).unwrap();
    let store = collector.take();
    assert!(collector.is_empty());
    assert_eq!(store.get_ids().count(), 2);
    assert_equal(
        "taken ∂weight",
        store.get(layer.weight()).unwrap(),
        &weight_grad,
    );
    assert!(store.get(layer.bias().unwrap()).is_some());
}
