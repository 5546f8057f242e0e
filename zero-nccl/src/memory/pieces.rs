//! The optimizer state between its device form (flat tensors over the
//! whole shard) and the host optimizers' form (per piece, keyed by
//! parameter name and offset, under `torch.optim`'s names), which is what
//! checkpoints hold. Pure logic, tested without a GPU: this is what makes a
//! GPU checkpoint load on threads or MPI and back.

use std::collections::BTreeMap;
use std::ops::Range;
use zero_core::engine::StepPiece;
use zero_core::optim::{OptimizerState, ParamState};
use zero_core::{Error, Result};

/// What distinguishes one optimizer's state format.
#[derive(Clone, Copy, Debug)]
pub struct StateFormat {
    /// The optimizer kind, for messages.
    pub kind: &'static str,
    /// Whether each piece carries a `step` scalar (all but SGD).
    pub has_step: bool,
    /// The element-wise tensors it may hold.
    pub tensors: &'static [&'static str],
}

fn overlaps(ranges: &[Range<usize>], range: &Range<usize>) -> bool {
    ranges
        .iter()
        .any(|r| r.start < range.end && range.start < r.end)
}

/// Cuts a whole-shard state into the host format: one entry per piece that
/// has stepped (`piece_steps`), with its `step` and its range of every
/// tensor. Pieces never stepped have no entry, as on the host; a piece that
/// overlaps `momentum_unstarted` has no `momentum_buffer` (SGD: torch has
/// none before the first step with momentum).
pub fn split_state(
    format: StateFormat,
    whole: &ParamState<f32>,
    pieces: &[StepPiece<'_>],
    piece_steps: &BTreeMap<(String, usize), u64>,
    momentum_unstarted: &[Range<usize>],
) -> OptimizerState<f32> {
    let mut out = OptimizerState::default();
    for piece in pieces {
        let key = (piece.key.name.clone(), piece.key.offset);
        let step = piece_steps.get(&key).copied().unwrap_or(0);
        if step == 0 {
            continue;
        }
        let mut state = ParamState::default();
        if format.has_step {
            state.scalars.insert("step".into(), step as f64);
        }
        let unstarted = overlaps(momentum_unstarted, &piece.range);
        for (name, values) in &whole.tensors {
            if name == "momentum_buffer" && unstarted {
                continue;
            }
            if let Some(values) = values.get(piece.range.clone()) {
                state.tensors.insert(name.clone(), values.to_vec());
            }
        }
        out.params.insert(key, state);
    }
    out
}

/// What [`merge_state`] learned from the imported pieces.
#[derive(Debug, Default, PartialEq)]
pub struct Merged {
    /// The step count of every imported piece.
    pub steps: Vec<((String, usize), u64)>,
    /// The shard ranges whose momentum buffer has not started (SGD): the
    /// imported pieces without one, and the untouched pieces that had none.
    pub momentum_unstarted: Vec<Range<usize>>,
}

/// Writes the pieces of `state` into the whole-shard state `whole`
/// (tensors of `len` elements; a tensor `whole` lacks starts as zeros), the
/// other pieces keeping theirs. Every entry must be a piece of `pieces`
/// with tensors as long as the piece and names of `format`. `unstarted`:
/// the ranges whose momentum had not started before.
pub fn merge_state(
    format: StateFormat,
    whole: &mut ParamState<f32>,
    len: usize,
    pieces: &[StepPiece<'_>],
    mut state: OptimizerState<f32>,
    unstarted: &[Range<usize>],
) -> Result<Merged> {
    let kind = format.kind;
    let mut merged = Merged::default();
    for piece in pieces {
        let key = (piece.key.name.clone(), piece.key.offset);
        let Some(mut piece_state) = state.params.remove(&key) else {
            if overlaps(unstarted, &piece.range) {
                merged.momentum_unstarted.push(piece.range.clone());
            }
            continue;
        };
        let step = match piece_state.scalars.remove("step") {
            Some(step) if step >= 0.0 && step.fract() == 0.0 => step as u64,
            Some(step) => {
                return Err(Error::Optimizer(format!(
                    "{kind}: state of parameter {:?}: step {step} is not a non-negative integer",
                    key.0
                )))
            }
            // SGD keeps no step; its state means "stepped".
            None if !format.has_step => 1,
            None => {
                return Err(Error::Optimizer(format!(
                    "{kind}: state of parameter {:?} has no \"step\"",
                    key.0
                )))
            }
        };
        if let Some(extra) = piece_state.scalars.keys().next() {
            return Err(Error::Optimizer(format!(
                "{kind}: state of parameter {:?} has the scalar {extra:?}, which a {kind} \
                 optimizer does not use; was it exported by another optimizer?",
                key.0
            )));
        }
        if !piece_state.tensors.contains_key("momentum_buffer") {
            merged.momentum_unstarted.push(piece.range.clone());
        }
        for (name, values) in piece_state.tensors {
            if !format.tensors.contains(&name.as_str()) {
                return Err(Error::Optimizer(format!(
                    "{kind}: state of parameter {:?} has {name:?}, which a {kind} optimizer \
                     does not use; was it exported by another optimizer?",
                    key.0
                )));
            }
            if values.len() != piece.range.len() || piece.range.end > len {
                return Err(Error::Optimizer(format!(
                    "{kind}: state {name:?} of parameter {:?} at offset {} has {} elements, the \
                     piece has {}; was it imported from a different partitioning?",
                    key.0,
                    key.1,
                    values.len(),
                    piece.range.len()
                )));
            }
            let tensor = whole.tensors.entry(name).or_insert_with(|| vec![0.0; len]);
            tensor.resize(len, 0.0);
            tensor[piece.range.clone()].copy_from_slice(&values);
        }
        merged.steps.push((key, step));
    }
    if let Some(((name, offset), _)) = state.params.iter().next() {
        return Err(Error::Optimizer(format!(
            "{kind}: state for parameter {name:?} at offset {offset}, a piece this rank does not \
             own"
        )));
    }
    Ok(merged)
}

#[cfg(test)]
// One range in a slice is the point here (a set of ranges with one member).
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use zero_core::optim::{
        Adam, AdamConfig, FunctionalOptimizer, ParamKey, ParamMut, Sgd, SgdConfig,
    };

    const ADAM: StateFormat = StateFormat {
        kind: "adam",
        has_step: true,
        tensors: &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    };
    const SGD: StateFormat = StateFormat {
        kind: "sgd",
        has_step: false,
        tensors: &["momentum_buffer"],
    };

    /// Two pieces of one shard with padding between them: `w` at 0..5 and
    /// `b` at 8..11.
    fn keys() -> Vec<ParamKey> {
        vec![ParamKey::new("w", 3, 0), ParamKey::new("b", 0, 0)]
    }

    fn pieces(keys: &[ParamKey]) -> Vec<StepPiece<'_>> {
        vec![
            StepPiece {
                key: &keys[0],
                range: 0..5,
                active: true,
            },
            StepPiece {
                key: &keys[1],
                range: 8..11,
                active: true,
            },
        ]
    }

    /// Steps a host optimizer on the pieces; `b` skips the last step.
    fn host_state(opt: &mut dyn FunctionalOptimizer<f32>, steps: usize) -> OptimizerState<f32> {
        let keys = keys();
        let mut w = vec![0.5f32; 5];
        let mut b = vec![-0.25f32; 3];
        for s in 0..steps {
            let gw: Vec<f32> = (0..5).map(|i| (i + s) as f32 * 0.1 - 0.2).collect();
            let gb: Vec<f32> = (0..3).map(|i| 0.3 - (i * s) as f32 * 0.05).collect();
            let mut params = [
                ParamMut {
                    key: &keys[0],
                    data: &mut w,
                },
                ParamMut {
                    key: &keys[1],
                    data: &mut b,
                },
            ];
            let grads = [Some(&gw[..]), (s + 1 < steps).then_some(&gb[..])];
            opt.step(&mut params, &grads).unwrap();
        }
        opt.export_state()
    }

    #[test]
    fn a_host_state_crosses_the_device_format_and_back_unchanged() {
        let mut adam = Adam::<f32>::new(AdamConfig::default().with_amsgrad(true)).unwrap();
        let host = host_state(&mut adam, 3);
        let keys = keys();
        let pieces = pieces(&keys);
        let mut whole = ParamState::default();
        let merged = merge_state(ADAM, &mut whole, 11, &pieces, host.clone(), &[]).unwrap();
        assert_eq!(
            merged.steps,
            vec![(("w".to_string(), 3), 3), (("b".to_string(), 0), 2)]
        );
        // The padding between the pieces stays zero.
        assert_eq!(&whole.tensors["exp_avg"][5..8], &[0.0; 3]);
        let steps: BTreeMap<_, _> = merged.steps.into_iter().collect();
        let back = split_state(ADAM, &whole, &pieces, &steps, &[]);
        assert_eq!(back, host);
    }

    #[test]
    fn unstepped_pieces_have_no_state_and_sgd_no_step() {
        let mut sgd = Sgd::<f32>::new(SgdConfig::default().with_momentum(0.9)).unwrap();
        let host = host_state(&mut sgd, 2);
        let keys = keys();
        let pieces = pieces(&keys);
        let mut whole = ParamState::default();
        let merged = merge_state(SGD, &mut whole, 11, &pieces, host.clone(), &[]).unwrap();
        assert!(merged.momentum_unstarted.is_empty());
        let mut steps: BTreeMap<_, _> = merged.steps.into_iter().collect();
        assert_eq!(split_state(SGD, &whole, &pieces, &steps, &[]), host);
        // A piece that never stepped exports nothing; one whose momentum
        // never started exports no buffer.
        steps.remove(&("b".to_string(), 0));
        let out = split_state(SGD, &whole, &pieces, &steps, &[0..5]);
        assert_eq!(out.params.len(), 1);
        assert!(out.params[&("w".to_string(), 3)].tensors.is_empty());
        assert!(out.params[&("w".to_string(), 3)].scalars.is_empty());
    }

    #[test]
    fn an_import_keeps_untouched_pieces_and_refuses_what_does_not_fit() {
        let keys = keys();
        let pieces = pieces(&keys);
        let mut whole = ParamState::default();
        whole
            .tensors
            .insert("momentum_buffer".into(), vec![7.0; 11]);
        let mut only_w = OptimizerState::default();
        only_w.params.insert(
            ("w".into(), 3),
            ParamState {
                scalars: BTreeMap::new(),
                tensors: [("momentum_buffer".to_string(), vec![1.0; 5])].into(),
            },
        );
        // `b` had not started its momentum and is not in the import.
        let merged = merge_state(SGD, &mut whole, 11, &pieces, only_w.clone(), &[8..11]).unwrap();
        assert_eq!(merged.momentum_unstarted, vec![8..11]);
        assert_eq!(&whole.tensors["momentum_buffer"][..5], &[1.0; 5]);
        assert_eq!(&whole.tensors["momentum_buffer"][8..], &[7.0; 3]);

        let mut wrong_len = only_w.clone();
        wrong_len
            .params
            .get_mut(&("w".to_string(), 3))
            .unwrap()
            .tensors
            .insert("momentum_buffer".into(), vec![1.0; 4]);
        let err = merge_state(SGD, &mut whole, 11, &pieces, wrong_len, &[]).unwrap_err();
        assert!(err.to_string().contains("different partitioning"), "{err}");

        let mut foreign = only_w.clone();
        foreign
            .params
            .insert(("x".into(), 0), ParamState::default());
        let err = merge_state(SGD, &mut whole, 11, &pieces, foreign, &[]).unwrap_err();
        assert!(err.to_string().contains("does not own"), "{err}");

        let mut other_kind = only_w;
        other_kind
            .params
            .get_mut(&("w".to_string(), 3))
            .unwrap()
            .tensors
            .insert("exp_avg".into(), vec![0.0; 5]);
        let err = merge_state(SGD, &mut whole, 11, &pieces, other_kind, &[]).unwrap_err();
        assert!(err.to_string().contains("another optimizer"), "{err}");
    }
}
