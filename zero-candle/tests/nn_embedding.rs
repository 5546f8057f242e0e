//! `zero_candle::nn::Embedding` against `candle_nn::Embedding` built over the
//! same table: the same rows, and the hook gets exactly the table gradient
//! candle-nn's backward puts in its `GradStore` (repeated ids summed).

mod nn_support;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use nn_support::{assert_equal, hook, weighted_sum, Recorder};
use zero_candle::nn;

const VOCAB: usize = 11;
const DIM: usize = 6;

/// Ids with repeats, of `dtype`, shaped `[2, 5]`.
fn ids(dtype: DType) -> Tensor {
    let ids: Vec<u32> = vec![3, 0, 7, 3, 10, 3, 1, 0, 9, 7];
    Tensor::from_vec(ids, (2, 5), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn compare(dtype: DType, id_dtype: DType) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let reference = candle_nn::embedding(VOCAB, DIM, vb.pp("emb")).unwrap();
    let recorder = Recorder::new();
    let layer = nn::embedding(VOCAB, DIM, vb.pp("emb"), hook(&recorder)).unwrap();
    let table = reference.embeddings();
    assert_eq!(layer.embeddings().id(), table.id());
    assert_eq!(layer.hidden_size(), DIM);

    let ids = ids(id_dtype);
    let want_y = reference.forward(&ids).unwrap();
    let got_y = layer.forward(&ids).unwrap();
    assert_eq!(got_y.dims(), [2, 5, DIM]);
    assert_equal("rows", &got_y, &want_y);
    let want = weighted_sum(&want_y, 1).backward().unwrap();
    let got = weighted_sum(&got_y, 1).backward().unwrap();
    assert_equal("∂table", &recorder.grad_of(table), want.get(table).unwrap());
    assert!(got.get(table).is_none(), "the hook took ∂table");
}

#[test]
fn every_dtype_matches_candle_nn_exactly() {
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        compare(dtype, DType::U32);
    }
    compare(DType::F32, DType::I64);
    compare(DType::F32, DType::U8);
}

#[test]
fn without_a_hook_the_gradient_is_in_the_grad_store() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let reference = candle_nn::embedding(VOCAB, DIM, vb.pp("emb")).unwrap();
    let layer = nn::embedding(VOCAB, DIM, vb.pp("emb"), None).unwrap();
    let ids = ids(DType::U32);
    let want = weighted_sum(&reference.forward(&ids).unwrap(), 2)
        .backward()
        .unwrap();
    let got = weighted_sum(&layer.forward(&ids).unwrap(), 2)
        .backward()
        .unwrap();
    let table = reference.embeddings();
    assert_equal(
        "GradStore entry",
        got.get(table).unwrap(),
        want.get(table).unwrap(),
    );
}

#[test]
fn an_id_outside_the_vocabulary_is_an_error_not_a_panic() {
    let table = Tensor::zeros((VOCAB, DIM), DType::F32, &Device::Cpu).unwrap();
    let layer = nn::Embedding::new(table, DIM, None);
    let bad = Tensor::new(&[1u32, VOCAB as u32], &Device::Cpu).unwrap();
    assert!(layer.forward(&bad).is_err());
}
