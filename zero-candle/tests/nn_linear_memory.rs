//! What an MLP's graph keeps between its forward and its backward: with the
//! activation on the second layer's input (`Linear::forward_on_activated`)
//! one `[rows, hidden]` tensor per block, where the activation after the
//! first layer (`Linear::forward_activated`) keeps two (the pre-activation
//! and the activation the next layer reads). A counting allocator measures
//! the live heap (this test binary holds one test, so nothing else
//! allocates meanwhile).

use candle_core::{DType, Device, Module, Tensor, Var};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use zero_candle::nn::{Activation, Linear};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const ROWS: usize = 256;
const WIDTH: usize = 64;
const HIDDEN: usize = 1024;
const BLOCKS: usize = 3;

/// A block's two layers, seeded.
fn block(seed: u64) -> (Linear, Linear) {
    let layer = |seed: u64, out: usize, inp: usize| {
        let w = Tensor::rand(-0.1f32, 0.1, (out, inp), &Device::Cpu).unwrap();
        let b = Tensor::full(seed as f32 * 1e-3, out, &Device::Cpu).unwrap();
        Linear::new(
            Var::from_tensor(&w).unwrap().as_tensor().clone(),
            Some(Var::from_tensor(&b).unwrap().as_tensor().clone()),
            None,
        )
    };
    (layer(seed, HIDDEN, WIDTH), layer(seed + 1, WIDTH, HIDDEN))
}

/// The blocks' forward with the activation on `input` or after the first
/// layer; the output, and the live heap bytes it holds beyond the start.
fn forward(blocks: &[(Linear, Linear)], x: &Tensor, on_input: bool) -> (Vec<f32>, isize) {
    let before = LIVE.load(Ordering::Relaxed);
    let mut h = x.clone();
    for (fc, proj) in blocks {
        let out = match on_input {
            true => proj.forward_on_activated(&fc.forward(&h).unwrap(), Activation::Gelu),
            false => proj.forward(&fc.forward_activated(&h, Activation::Gelu).unwrap()),
        };
        h = (out.unwrap() + &h).unwrap();
    }
    let held = LIVE.load(Ordering::Relaxed) - before;
    let values = h.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // The backward runs; the graph is released with `h`.
    let grads = h.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(x).is_some(), "the input has a gradient");
    (values, held)
}

#[test]
fn an_activation_on_the_next_layer_s_input_keeps_one_hidden_tensor_per_block() {
    let blocks: Vec<(Linear, Linear)> = (0..BLOCKS as u64).map(|s| block(2 * s)).collect();
    let x =
        Var::from_tensor(&Tensor::rand(-1f32, 1.0, (ROWS, WIDTH), &Device::Cpu).unwrap()).unwrap();
    // Twice each, alternating: the first calls warm what persists.
    let mut held = [Vec::new(), Vec::new()];
    let mut outputs = [Vec::new(), Vec::new()];
    for _ in 0..2 {
        for on_input in [false, true] {
            let (values, bytes) = forward(&blocks, x.as_tensor(), on_input);
            held[usize::from(on_input)].push(bytes);
            outputs[usize::from(on_input)] = values;
        }
    }
    assert_eq!(outputs[0], outputs[1], "the same outputs");
    let hidden_bytes = (ROWS * HIDDEN * DType::F32.size_in_bytes() * BLOCKS) as isize;
    let (after, on_input) = (held[0][1], held[1][1]);
    assert!(
        after - on_input >= hidden_bytes * 9 / 10,
        "the activation after the layer holds {after} bytes, on the next layer's input \
         {on_input}: not {hidden_bytes} less"
    );
}
