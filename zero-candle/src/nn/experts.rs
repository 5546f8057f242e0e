//! A mixture's experts as one op: gated MLPs over the rows routed to each,
//! their weight (and bias) gradients handed to the hook.

use super::cpu;
use super::grad_hook::{
    assemble, before_read, gather, route, Behind, GatheredParam, GradHook, StretchView,
};
use super::ops::Gating;
use super::storage::{on_device, owned_storage, OnDevice};
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, D,
};
use gemm::Parallelism;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

/// The experts of a mixture layer, `down(unit(gate(x), up(x)))` each, run
/// as one op per layer: each expert's rows are a slice of the routed rows,
/// its products plain GEMMs over its weights, the backward one pass that
/// hands every expert's gradients to the hook (an expert with no rows gets
/// zeros) and adds the rows' gradients into the input's.
/// On the CPU in f32 the experts run in parallel, one core each, where
/// their weights are the variables' own (every stage but 3); at stage 3 an
/// expert's weights are gathered, used and given back before the next's.
/// Elsewhere (CUDA, other dtypes) each expert is a few tensor ops, still
/// one graph node per layer.
///
/// Only with a hook: without one the gradients belong in the `GradStore`,
/// which only ops taking the weights as inputs can fill (one [`Linear`]
/// per projection).
///
/// [`Linear`]: super::Linear
#[derive(Clone)]
pub(crate) struct ExpertMlps {
    /// Per expert, its variables in `form`'s order.
    weights: Arc<[Vec<Tensor>]>,
    form: ExpertForm,
    gating: Gating,
    hook: Arc<dyn GradHook>,
}

/// How an expert's variables hold its projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertForm {
    /// `[gate, up, down]`: gate and up `[width, hidden]`, down `[hidden,
    /// width]`, no biases (Mixtral's, Qwen's and most mixtures').
    Separate,
    /// `[gate_up, gate_up_bias, down, down_bias]` (gpt-oss's): gate_up
    /// `[2 width, hidden]` whose rows alternate gate's and up's, its bias
    /// `[2 width]` alike, down `[hidden, width]` and its bias `[hidden]`.
    Interleaved,
}

impl ExpertForm {
    /// The expert's variables' shapes for its `width` and `hidden` size.
    fn shapes(self, width: usize, hidden: usize) -> Vec<Vec<usize>> {
        match self {
            Self::Separate => vec![
                vec![width, hidden],
                vec![width, hidden],
                vec![hidden, width],
            ],
            Self::Interleaved => vec![
                vec![2 * width, hidden],
                vec![2 * width],
                vec![hidden, width],
                vec![hidden],
            ],
        }
    }
}

/// Where the down projection's weight is among an expert's variables, in
/// either form.
const DOWN: usize = 2;

/// Where one expert's forward writes its rows' output and gate and up
/// products, `[rows, ..]`.
struct ExpertRows<'a> {
    out: &'a mut [f32],
    gate: &'a mut [f32],
    up: &'a mut [f32],
}

/// `values` (rows of `cols`) cut into each range's rows.
fn rows_of<'a>(values: &'a mut [f32], ranges: &[Range<usize>], cols: usize) -> Vec<&'a mut [f32]> {
    let mut rest = values;
    let mut parts = Vec::with_capacity(ranges.len());
    for range in ranges {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(range.len() * cols);
        parts.push(part);
        rest = tail;
    }
    parts
}

/// What the forward keeps for the backward.
struct Saved {
    /// The rows of the input each routed row is (`[routed]`, u32).
    rows: Tensor,
    /// The gate and up products of every routed row (their biases added),
    /// `[routed, width]`.
    gate: Tensor,
    up: Tensor,
}

/// The op `h [tokens, hidden] -> [routed, hidden]`, its result computed
/// before it ran.
struct ExpertsOp {
    experts: ExpertMlps,
    ranges: Arc<[Range<usize>]>,
    output: Mutex<Option<Storage>>,
    saved: Saved,
    /// The weights behind the output, for the hook to predict them.
    behind: Arc<Behind>,
}

const OUTPUT: &str = "the experts' output";

impl ExpertMlps {
    /// The experts whose variables are `weights` (each expert's in `form`'s
    /// order), all of one width and hidden size, `gating` their unit; their
    /// gradients go to `hook`, which their layers have already been
    /// announced to.
    pub(crate) fn new(
        weights: Vec<Vec<Tensor>>,
        form: ExpertForm,
        gating: Gating,
        hook: Arc<dyn GradHook>,
    ) -> Result<Self> {
        let Some(first) = weights.first() else {
            bail!("zero-candle experts: a mixture needs at least one expert")
        };
        let Some((hidden, width)) = first.get(DOWN).and_then(|d| d.dims2().ok()) else {
            bail!("zero-candle experts: expert 0's variables do not hold a {form:?} expert")
        };
        let shapes = form.shapes(width, hidden);
        for (e, vars) in weights.iter().enumerate() {
            let theirs: Vec<&[usize]> = vars.iter().map(|v| v.dims()).collect();
            if theirs != shapes.iter().map(|s| &s[..]).collect::<Vec<_>>() {
                bail!(
                    "zero-candle experts: expert {e}'s variables are {theirs:?}; every {form:?} \
                     expert's must be {shapes:?}"
                )
            }
        }
        Ok(Self {
            weights: weights.into(),
            form,
            gating,
            hook,
        })
    }

    /// The experts' sizes.
    fn dims(&self) -> Result<Dims> {
        let (hidden, width) = self.weights[0][DOWN].dims2()?;
        Ok(Dims {
            hidden,
            width,
            form: self.form,
            gating: self.gating,
        })
    }

    /// Expert `e`'s MLP over rows `rows[ranges[e]]` of `h` `[tokens,
    /// hidden]`, for every expert: `[routed, hidden]`, in the order of
    /// `rows` (`[routed]`, u32, on `h`'s device). `ranges` cover `rows` in
    /// order.
    pub(crate) fn forward(
        &self,
        h: &Tensor,
        rows: &Tensor,
        ranges: &[Range<usize>],
    ) -> Result<Tensor> {
        let routed = rows.dim(0)?;
        let in_order = ranges
            .iter()
            .try_fold(0, |at, r| (r.start == at).then_some(r.end));
        if ranges.len() != self.weights.len() || in_order != Some(routed) {
            bail!(
                "zero-candle experts: {} row ranges {ranges:?} for {} experts over {} rows; \
                 give each expert one range, in order, covering the rows",
                ranges.len(),
                self.weights.len(),
                routed
            )
        }
        let all: Vec<Option<&Tensor>> = self.weights.iter().flatten().map(Some).collect();
        before_read(Some(&self.hook), &all)?;
        let h = h.contiguous()?;
        let x = h.detach().index_select(rows, 0)?;
        let (out, gate, up) = match cpu_f32(&x) {
            true => self.forward_cpu(&x, ranges)?,
            false => {
                let (out, gate, up) = self.forward_tensors(&x, ranges)?;
                (owned_storage(&out, OUTPUT)?, gate, up)
            }
        };
        let op = ExpertsOp {
            experts: self.clone(),
            ranges: ranges.into(),
            output: Mutex::new(Some(out)),
            saved: Saved {
                rows: rows.clone(),
                gate,
                up,
            },
            behind: Arc::default(),
        };
        let behind = op.behind.clone();
        let out = h.apply_op1(op)?;
        // The variables' gradients in the order the backward hands them over.
        let tracked = self.weights.iter().flatten().filter(|w| w.track_op());
        behind.place(out.id(), Arc::new(tracked.map(Tensor::id).collect()));
        Ok(out)
    }

    /// Each expert's variables lent for one computation, in order: the
    /// variables' own runs of experts together, each lent one alone.
    fn runs(&self) -> Result<Vec<Run>> {
        let mut runs: Vec<Run> = Vec::new();
        for (e, weights) in self.weights.iter().enumerate() {
            let lent = weights
                .iter()
                .map(|w| gather(Some(&self.hook), Some(w), 0))
                .collect::<Result<Vec<_>>>()?;
            if lent.iter().all(Option::is_none) {
                if let Some(Run::Own(range)) = runs.last_mut() {
                    range.end = e + 1;
                } else {
                    runs.push(Run::Own(e..e + 1));
                }
                continue;
            }
            let mut values = Vec::with_capacity(weights.len());
            for (w, first) in weights.iter().zip(lent) {
                values.push(Values::of(&self.hook, w, first)?);
            }
            runs.push(Run::Lent(e, values));
        }
        Ok(runs)
    }

    /// The forward over `x` `[routed, hidden]` on the CPU in f32: the
    /// output's storage and the gate and up products, each expert writing
    /// its rows.
    fn forward_cpu(
        &self,
        x: &Tensor,
        ranges: &[Range<usize>],
    ) -> Result<(Storage, Tensor, Tensor)> {
        let routed = x.dim(0)?;
        let dims = self.dims()?;
        let (hidden, width) = (dims.hidden, dims.width);
        let (mut out, mut gate, mut up) = (
            vec![0f32; routed * hidden],
            vec![0f32; routed * width],
            vec![0f32; routed * width],
        );
        let sinks: Vec<_> = rows_of(&mut out, ranges, hidden)
            .into_iter()
            .zip(rows_of(&mut gate, ranges, width))
            .zip(rows_of(&mut up, ranges, width))
            .map(|((out, gate), up)| ExpertRows { out, gate, up })
            .collect();
        with_f32s([x], |[x]| {
            self.run_cpu(sinks, |e, w, par, rows| {
                let x = &x[ranges[e].start * hidden..ranges[e].end * hidden];
                dims.forward(x, w, par, rows)
            })
        })?;
        let device = x.device();
        Ok((
            Storage::Cpu(CpuStorage::F32(out)),
            Tensor::from_vec(gate, (routed, width), device)?,
            Tensor::from_vec(up, (routed, width), device)?,
        ))
    }

    /// `expert(e, variables, parallelism, sink)` for every expert `e`, in
    /// order, on f32 CPU values, `sinks[e]` where it writes: runs of
    /// experts with their own variables in parallel (one core each), one
    /// with lent variables alone (on all cores).
    fn run_cpu<S: Send, T: Send>(
        &self,
        sinks: Vec<S>,
        expert: impl Fn(usize, &[&[f32]], Parallelism, S) -> T + Sync,
    ) -> Result<Vec<T>> {
        let vars = self.weights[0].len();
        let mut done = Vec::with_capacity(self.weights.len());
        let mut sinks = sinks.into_iter();
        for run in self.runs()? {
            match run {
                Run::Own(experts) => {
                    let weights = self.weights[experts.clone()].iter().flatten();
                    let guards: Vec<_> = weights.map(|w| w.storage_and_layout()).collect();
                    let slices = read_f32(&guards)?;
                    let run_sinks: Vec<S> = sinks.by_ref().take(experts.len()).collect();
                    let results: Vec<T> = experts
                        .into_par_iter()
                        .zip(slices.par_chunks(vars))
                        .zip(run_sinks)
                        .map(|((e, w), sink)| expert(e, w, Parallelism::None, sink))
                        .collect();
                    done.extend(results);
                }
                Run::Lent(e, values) => {
                    let held = values.iter().filter_map(|v| match v {
                        Values::Own(t) | Values::Assembled(t) => Some(t.storage_and_layout()),
                        Values::Whole(_) => None,
                    });
                    let guards: Vec<_> = held.collect();
                    let mut held = read_f32(&guards)?.into_iter();
                    let mut w = Vec::with_capacity(vars);
                    for v in &values {
                        w.push(match v {
                            Values::Whole(lent) => whole_f32(lent)?,
                            Values::Own(_) | Values::Assembled(_) => {
                                held.next().expect("one per tensor")
                            }
                        });
                    }
                    let threads = Parallelism::Rayon(rayon::current_num_threads());
                    let sink = sinks.next().expect("a sink per expert");
                    done.push(expert(e, &w, threads, sink));
                }
            }
        }
        Ok(done)
    }

    /// The forward over `x` `[routed, hidden]` as tensor ops, an expert
    /// at a time.
    fn forward_tensors(
        &self,
        x: &Tensor,
        ranges: &[Range<usize>],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dims = self.dims()?;
        let (mut outs, mut gates, mut ups) = (vec![], vec![], vec![]);
        for_each_expert(self, |e, values| {
            // An expert without rows still gathers (stage 3's gathers
            // match across ranks) but runs no empty product.
            if ranges[e].is_empty() {
                return Ok(());
            }
            let x = x.narrow(0, ranges[e].start, ranges[e].len())?;
            let (gate, up) = dims.gate_up_tensors(&x, values)?;
            let mid = self.gating.forward(&gate, &up)?;
            outs.push(dims.down_tensors(&mid, values)?);
            gates.push(gate);
            ups.push(up);
            Ok(())
        })?;
        let empty = |cols| Tensor::zeros((0, cols), x.dtype(), x.device());
        let cat = |parts: &[Tensor], cols| match parts {
            [] => empty(cols),
            parts => Tensor::cat(parts, 0),
        };
        Ok((
            cat(&outs, dims.hidden)?,
            cat(&gates, dims.width)?,
            cat(&ups, dims.width)?,
        ))
    }
}

/// Runs `f(e, values)` for every expert in order, with its variables'
/// values (the variables', or what the hook lends, given back before the
/// next expert's are gathered).
fn for_each_expert(
    experts: &ExpertMlps,
    mut f: impl FnMut(usize, &[Values]) -> Result<()>,
) -> Result<()> {
    for (e, weights) in experts.weights.iter().enumerate() {
        let mut values = Vec::with_capacity(weights.len());
        for w in weights {
            let first = gather(Some(&experts.hook), Some(w), 0)?;
            values.push(Values::of(&experts.hook, w, first)?);
        }
        f(e, &values)?;
    }
    Ok(())
}

/// Experts computed together: a run of those whose weights are the
/// variables' own, or one whose weights the hook lent.
enum Run {
    Own(Range<usize>),
    Lent(usize, Vec<Values>),
}

/// A variable's values for one computation: the variable's own, or lent
/// by the hook, whole (read in place) or assembled from its pieces.
enum Values {
    Own(Tensor),
    Whole(Box<GatheredParam>),
    Assembled(Tensor),
}

impl Values {
    fn of(hook: &Arc<dyn GradHook>, w: &Tensor, first: Option<GatheredParam>) -> Result<Self> {
        Ok(match first {
            None => Self::Own(w.detach()),
            Some(first) if first.whole().is_some() => Self::Whole(Box::new(first)),
            first => Self::Assembled(assemble(Some(hook), w, first)?),
        })
    }

    /// `lhs · W` for this weight `W` of `dims`, or `lhs · Wᵀ` when
    /// `transposed`; a lent weight read where it lies.
    fn product(&self, lhs: &Tensor, dims: (usize, usize), transposed: bool) -> Result<Tensor> {
        match self {
            Self::Own(w) | Self::Assembled(w) => match transposed {
                true => lhs.matmul(&w.t()?),
                false => lhs.matmul(w),
            },
            Self::Whole(lent) => {
                let at = lent.stretches()[0].at.clone();
                let view = StretchView::Piece { piece: lent, at };
                view.matmul(lhs, 0, dims, transposed)
            }
        }
    }

    /// The values as a 1-d tensor of `len` on `device` (a copy of a lent
    /// one: biases).
    fn flat(&self, len: usize, device: &candle_core::Device) -> Result<Tensor> {
        match self {
            Self::Own(t) | Self::Assembled(t) => t.flatten_all(),
            Self::Whole(lent) => {
                let at = lent.stretches()[0].at.clone();
                StretchView::Piece { piece: lent, at }.tensor(0..len, device)
            }
        }
    }
}

/// A weight the hook lent whole, as f32 CPU values.
fn whole_f32(lent: &GatheredParam) -> Result<&[f32]> {
    match lent.whole_on::<CpuStorage>() {
        Some((storage, layout)) => cpu::slice::<f32>(storage, layout, "a gathered expert"),
        None => bail!(
            "zero-candle experts: a gathered weight is not on the CPU but the input is; keep the \
             model and its inputs on one device"
        ),
    }
}

/// Storages held for reading, and their layouts.
type Held<'a> = (candle_core::StorageRef<'a>, &'a Layout);

/// The f32 CPU values of `held` storages (contiguous).
fn read_f32<'a>(held: &'a [Held<'_>]) -> Result<Vec<&'a [f32]>> {
    held.iter()
        .map(|(storage, layout)| match &**storage {
            Storage::Cpu(storage) => cpu::slice::<f32>(storage, layout, "the experts' tensors"),
            _ => bail!(
                "zero-candle experts: the weights are not on the CPU but the input is; keep the \
                 model and its inputs on one device"
            ),
        })
        .collect()
}

/// `f` over the f32 CPU values of contiguous `tensors`.
fn with_f32s<R, const N: usize>(
    tensors: [&Tensor; N],
    f: impl FnOnce([&[f32]; N]) -> Result<R>,
) -> Result<R> {
    let held: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let values = read_f32(&held)?;
    f(values
        .try_into()
        .unwrap_or_else(|_| unreachable!("N tensors")))
}

/// Whether `t` is an f32 CPU tensor (the experts' own CPU path).
fn cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// An expert's sizes, form and unit.
#[derive(Clone, Copy)]
struct Dims {
    hidden: usize,
    width: usize,
    form: ExpertForm,
    gating: Gating,
}

/// `dst [m, n] (+)= a · b`, each operand a row-major matrix or the
/// transpose of one.
struct Gemm<'a> {
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'a>,
    b: Operand<'a>,
}

/// A `[rows, cols]` operand: `values` a row-major matrix whose rows lie
/// `pitch` apart, read transposed when `transposed` (then that matrix is
/// `[cols, rows]`).
#[derive(Clone, Copy)]
struct Operand<'a> {
    values: &'a [f32],
    transposed: bool,
    pitch: Option<usize>,
}

fn plain(values: &[f32]) -> Operand<'_> {
    Operand {
        values,
        transposed: false,
        pitch: None,
    }
}

fn transposed(values: &[f32]) -> Operand<'_> {
    Operand {
        values,
        transposed: true,
        pitch: None,
    }
}

impl Operand<'_> {
    /// The same matrix with its rows `pitch` apart.
    fn pitched(self, pitch: usize) -> Self {
        Self {
            pitch: Some(pitch),
            ..self
        }
    }
}

impl Gemm<'_> {
    /// Runs the product into `dst`, adding to it when `accumulate`.
    fn run(&self, dst: &mut [f32], accumulate: bool, parallelism: Parallelism) {
        let (m, n) = (self.m, self.n);
        assert!(
            dst.len() == m * n,
            "a {m}x{n} product into {} values",
            dst.len()
        );
        self.run_pitched(dst, n, accumulate, parallelism);
    }

    /// [`Gemm::run`] into rows of `dst` `pitch` apart.
    fn run_pitched(
        &self,
        dst: &mut [f32],
        pitch: usize,
        accumulate: bool,
        parallelism: Parallelism,
    ) {
        let (m, n, k) = (self.m, self.n, self.k);
        assert!(
            pitch >= n && (m == 0 || dst.len() >= (m - 1) * pitch + n),
            "a {m}x{n} product into {} values at a pitch of {pitch}",
            dst.len()
        );
        // (row stride, column stride) of a [rows, cols] operand.
        let strides = |op: &Operand, rows: usize, cols: usize| {
            let (held_rows, held_cols) = match op.transposed {
                false => (rows, cols),
                true => (cols, rows),
            };
            let pitch = op.pitch.unwrap_or(held_cols);
            let fits = match (op.pitch, held_rows) {
                (None, _) => op.values.len() == held_rows * held_cols,
                (Some(_), 0) => true,
                (Some(_), rows) => {
                    pitch >= held_cols && op.values.len() >= (rows - 1) * pitch + held_cols
                }
            };
            assert!(fits, "an operand of the wrong size");
            match op.transposed {
                false => (pitch as isize, 1),
                true => (1, pitch as isize),
            }
        };
        let (a_rs, a_cs) = strides(&self.a, m, k);
        let (b_rs, b_cs) = strides(&self.b, k, n);
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            if !accumulate {
                dst.fill(0.0);
            }
            return;
        }
        // SAFETY: every operand holds its rows x cols values at its strides
        // (asserted), which address inside it; `dst` holds m rows of n
        // values `pitch` apart (asserted) and is borrowed mutably here alone.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                pitch as isize,
                accumulate,
                self.a.values.as_ptr(),
                a_cs,
                a_rs,
                self.b.values.as_ptr(),
                b_cs,
                b_rs,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            )
        }
    }

    fn into_new(self, parallelism: Parallelism) -> Vec<f32> {
        let mut dst = vec![0f32; self.m * self.n];
        self.run(&mut dst, false, parallelism);
        dst
    }
}

/// `rows` plus a bias each: column `c`'s is `bias[c * step]` (gpt-oss's
/// gate and up biases alternate in one variable).
fn add_bias(rows: &mut [f32], bias: &[f32], step: usize) {
    for row in rows.chunks_exact_mut(bias.len().div_ceil(step)) {
        for (v, b) in row.iter_mut().zip(bias.iter().step_by(step)) {
            *v += b;
        }
    }
}

/// Adds the column sums of `rows` into `sums`: column `c`'s into
/// `sums[c * step]`, the values between left as they are.
fn add_column_sums(rows: &[f32], sums: &mut [f32], step: usize) {
    for row in rows.chunks_exact(sums.len().div_ceil(step)) {
        for (s, v) in sums.iter_mut().step_by(step).zip(row) {
            *s += v;
        }
    }
}

impl Dims {
    /// The gate's and up's weights among an expert's variables `w`, as
    /// `[width, hidden]` operands.
    fn gate_up<'a>(self, w: &[&'a [f32]]) -> [Operand<'a>; 2] {
        let h = self.hidden;
        match self.form {
            ExpertForm::Separate => [plain(w[0]), plain(w[1])],
            ExpertForm::Interleaved => {
                [plain(w[0]).pitched(2 * h), plain(&w[0][h..]).pitched(2 * h)]
            }
        }
    }

    /// Rows `x` `[r, hidden]` through the expert of variables `w`, into
    /// `rows`.
    fn forward(self, x: &[f32], w: &[&[f32]], par: Parallelism, rows: ExpertRows) {
        let (h, i, r) = (self.hidden, self.width, x.len() / self.hidden);
        for (weight, dst) in self
            .gate_up(w)
            .into_iter()
            .zip([&mut *rows.gate, &mut *rows.up])
        {
            let b = Operand {
                transposed: true,
                ..weight
            };
            Gemm {
                m: r,
                n: i,
                k: h,
                a: plain(x),
                b,
            }
            .run(dst, false, par);
        }
        if self.form == ExpertForm::Interleaved {
            add_bias(rows.gate, w[1], 2);
            add_bias(rows.up, &w[1][1..], 2);
        }
        let mid = self.gating.cpu(rows.gate, rows.up);
        Gemm {
            m: r,
            n: h,
            k: i,
            a: plain(&mid),
            b: transposed(w[DOWN]),
        }
        .run(rows.out, false, par);
        if self.form == ExpertForm::Interleaved {
            add_bias(rows.out, w[3], 1);
        }
    }

    /// The backward of [`Dims::forward`] for the output gradient `g`
    /// `[r, hidden]`: the rows' gradient into `dx`, and the variables'.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        self,
        x: &[f32],
        gate: &[f32],
        up: &[f32],
        g: &[f32],
        w: &[&[f32]],
        par: Parallelism,
        dx: &mut [f32],
    ) -> Vec<Vec<f32>> {
        let (h, i, r) = (self.hidden, self.width, x.len() / self.hidden);
        let down = w[DOWN];
        let mid = self.gating.cpu(gate, up);
        let d_down = Gemm {
            m: h,
            n: i,
            k: r,
            a: transposed(g),
            b: plain(&mid),
        }
        .into_new(par);
        let d_mid = Gemm {
            m: r,
            n: i,
            k: h,
            a: plain(g),
            b: plain(down),
        }
        .into_new(par);
        let (d_gate_rows, d_up_rows) = self.gating.grads_cpu(gate, up, &d_mid);
        // A `[width, hidden]` weight's gradient from its rows' `d`, into
        // rows of `dst` `pitch` apart.
        let weight_grad = |d: &[f32], dst: &mut [f32], pitch: usize| {
            let product = Gemm {
                m: i,
                n: h,
                k: r,
                a: transposed(d),
                b: plain(x),
            };
            product.run_pitched(dst, pitch, false, par)
        };
        let [gate_w, up_w] = self.gate_up(w);
        for (rows, weight, accumulate) in [(&d_gate_rows, gate_w, false), (&d_up_rows, up_w, true)]
        {
            Gemm {
                m: r,
                n: h,
                k: i,
                a: plain(rows),
                b: weight,
            }
            .run(dx, accumulate, par);
        }
        match self.form {
            ExpertForm::Separate => {
                let (mut d_gate, mut d_up) = (vec![0f32; i * h], vec![0f32; i * h]);
                weight_grad(&d_gate_rows, &mut d_gate, h);
                weight_grad(&d_up_rows, &mut d_up, h);
                vec![d_gate, d_up, d_down]
            }
            ExpertForm::Interleaved => {
                // Gate's and up's rows alternate in the variable: each
                // product writes its rows in place, `2 h` apart.
                let mut d_gate_up = vec![0f32; 2 * i * h];
                let mut d_bias = vec![0f32; 2 * i];
                for (d, first) in [(&d_gate_rows, 0), (&d_up_rows, 1)] {
                    weight_grad(d, &mut d_gate_up[first * h..], 2 * h);
                    add_column_sums(d, &mut d_bias[first..], 2);
                }
                let mut d_down_bias = vec![0f32; h];
                add_column_sums(g, &mut d_down_bias, 1);
                vec![d_gate_up, d_bias, d_down, d_down_bias]
            }
        }
    }

    /// The gate and up products of rows `x` (their biases added), of an
    /// expert's `values`, as tensor ops.
    fn gate_up_tensors(self, x: &Tensor, values: &[Values]) -> Result<(Tensor, Tensor)> {
        let (h, i) = (self.hidden, self.width);
        match self.form {
            ExpertForm::Separate => Ok((
                values[0].product(x, (i, h), true)?,
                values[1].product(x, (i, h), true)?,
            )),
            ExpertForm::Interleaved => {
                let bias = values[1].flat(2 * i, x.device())?.to_dtype(x.dtype())?;
                let both = values[0]
                    .product(x, (2 * i, h), true)?
                    .broadcast_add(&bias)?
                    .reshape((x.dim(0)?, i, 2))?;
                let half = |p| {
                    both.narrow(D::Minus1, p, 1)?
                        .squeeze(D::Minus1)?
                        .contiguous()
                };
                Ok((half(0)?, half(1)?))
            }
        }
    }

    /// The down projection of `mid` (its bias added), as tensor ops.
    fn down_tensors(self, mid: &Tensor, values: &[Values]) -> Result<Tensor> {
        let out = values[DOWN].product(mid, (self.hidden, self.width), true)?;
        match self.form {
            ExpertForm::Separate => Ok(out),
            ExpertForm::Interleaved => {
                let bias = values[3]
                    .flat(self.hidden, mid.device())?
                    .to_dtype(mid.dtype())?;
                out.broadcast_add(&bias)
            }
        }
    }
}

impl CustomOp1 for ExpertsOp {
    fn name(&self) -> &'static str {
        "zero-experts"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.output()
    }

    fn cuda_fwd(&self, _s: &CudaStorage, _l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.output()
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let x = h.detach().contiguous()?.index_select(&self.saved.rows, 0)?;
        let (dx, grads) = match cpu_f32(&x) {
            true => self.backward_cpu(&x, &grad)?,
            false => self.backward_tensors(&x, &grad)?,
        };
        // Every expert's gradients, expert by expert, in order.
        for (weights, grads) in self.experts.weights.iter().zip(grads) {
            for (w, g) in weights.iter().zip(grads) {
                // A frozen weight (untracked) takes no gradient.
                if w.track_op() && route(Some(&self.experts.hook), w, g)?.is_some() {
                    bail!(
                        "zero-candle experts: a weight that is not a variable has no place for \
                         its gradient; build the experts over variables"
                    )
                }
            }
        }
        let dh = h.detach().zeros_like()?;
        Ok(Some(dh.index_add(&self.saved.rows, &dx, 0)?))
    }
}

impl ExpertsOp {
    fn output<S: OnDevice>(&self) -> Result<(S, Shape)> {
        let Some(output) = self
            .output
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            bail!("zero-candle experts: internal: the op ran twice on one forward's output")
        };
        let hidden = self.experts.dims()?.hidden;
        let routed = self.saved.rows.dim(0)?;
        Ok((on_device(output, OUTPUT)?, Shape::from((routed, hidden))))
    }

    /// The backward on the CPU in f32: the routed rows' gradient and each
    /// expert's variables'.
    fn backward_cpu(&self, x: &Tensor, grad: &Tensor) -> Result<(Tensor, Vec<Vec<Tensor>>)> {
        let experts = &self.experts;
        let routed = x.dim(0)?;
        let dims = experts.dims()?;
        let (hidden, width) = (dims.hidden, dims.width);
        let (gate, up) = (&self.saved.gate, &self.saved.up);
        let mut dx = vec![0f32; routed * hidden];
        let sinks = rows_of(&mut dx, &self.ranges, hidden);
        let done = with_f32s([x, grad, gate, up], |[x, g, gate, up]| {
            experts.run_cpu(sinks, |e, w, par, dx| {
                let range = &self.ranges[e];
                let rows = range.start * hidden..range.end * hidden;
                let mid = range.start * width..range.end * width;
                let (x, g) = (&x[rows.clone()], &g[rows]);
                let (gate, up) = (&gate[mid.clone()], &up[mid]);
                dims.backward(x, gate, up, g, w, par, dx)
            })
        })?;
        let device = x.device();
        let mut grads = Vec::with_capacity(done.len());
        for (vars, expert) in experts.weights.iter().zip(done) {
            let tensors = vars.iter().zip(expert);
            grads.push(
                tensors
                    .map(|(var, g)| Tensor::from_vec(g, var.shape(), device))
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        Ok((Tensor::from_vec(dx, (routed, hidden), device)?, grads))
    }

    /// The backward as tensor ops, an expert at a time.
    fn backward_tensors(&self, x: &Tensor, grad: &Tensor) -> Result<(Tensor, Vec<Vec<Tensor>>)> {
        let dims = self.experts.dims()?;
        let (h, i) = (dims.hidden, dims.width);
        let (mut dx, mut grads) = (Vec::new(), Vec::new());
        for_each_expert(&self.experts, |e, values| {
            let range = &self.ranges[e];
            if range.is_empty() {
                let zeros = self.experts.weights[e]
                    .iter()
                    .map(|w| w.detach().zeros_like());
                grads.push(zeros.collect::<Result<Vec<_>>>()?);
                return Ok(());
            }
            let rows = |t: &Tensor| t.narrow(0, range.start, range.len());
            let (x, g) = (rows(x)?, rows(grad)?);
            let (gate, up) = (rows(&self.saved.gate)?, rows(&self.saved.up)?);
            let mid = dims.gating.forward(&gate, &up)?;
            let d_down = g.t()?.matmul(&mid)?;
            let d_mid = values[DOWN].product(&g, (h, i), false)?;
            let (d_gate_rows, d_up_rows) = dims.gating.grads(&gate, &up, &d_mid)?;
            match dims.form {
                ExpertForm::Separate => {
                    let d_gate = d_gate_rows.t()?.matmul(&x)?;
                    let d_up = d_up_rows.t()?.matmul(&x)?;
                    dx.push(
                        (values[0].product(&d_gate_rows, (i, h), false)?
                            + values[1].product(&d_up_rows, (i, h), false)?)?,
                    );
                    grads.push(vec![d_gate, d_up, d_down]);
                }
                ExpertForm::Interleaved => {
                    let d_both = Tensor::stack(&[&d_gate_rows, &d_up_rows], 2)?
                        .reshape((range.len(), 2 * i))?;
                    dx.push(values[0].product(&d_both, (2 * i, h), false)?);
                    grads.push(vec![
                        d_both.t()?.matmul(&x)?,
                        d_both.sum(0)?,
                        d_down,
                        g.sum(0)?,
                    ]);
                }
            }
            Ok(())
        })?;
        let dx = match &dx[..] {
            [] => Tensor::zeros((0, h), x.dtype(), x.device())?,
            dx => Tensor::cat(dx, 0)?,
        };
        Ok((dx, grads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::Activation;
    use crate::nn::{vars_behind, GradCollector};
    use candle_core::{Device, Var};

    /// A `shape` tensor of fixed values in about ±`scale`, different for
    /// each `seed`.
    fn fixed(shape: (usize, usize), seed: usize, scale: f64, dtype: DType) -> Tensor {
        let n = shape.0 * shape.1;
        let values: Vec<f64> = (0..n)
            .map(|i| scale * ((i * 7 + seed * 131) as f64 * 0.61).sin())
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// The variables of `experts` experts of `width` over `hidden` in
    /// `form`'s order and shapes.
    fn weights(
        experts: usize,
        hidden: usize,
        width: usize,
        form: ExpertForm,
        dtype: DType,
    ) -> Vec<Vec<Var>> {
        let shapes = form.shapes(width, hidden);
        (0..experts)
            .map(|e| {
                let vars = shapes.iter().enumerate().map(|(v, shape)| {
                    let n = shape.iter().product();
                    let values = fixed((n, 1), 4 * e + v, 0.5, dtype).reshape(&shape[..]);
                    Var::from_tensor(&values.unwrap()).unwrap()
                });
                vars.collect()
            })
            .collect()
    }

    /// The variables' tensors, as `ExpertMlps::new` takes them.
    fn tensors(vars: &[Vec<Var>]) -> Vec<Vec<Tensor>> {
        let expert = |ws: &Vec<Var>| ws.iter().map(|w| w.as_tensor().clone()).collect();
        vars.iter().map(expert).collect()
    }

    /// One expert of Candle's ops over its rows `x`: `form`'s projections
    /// of its variables `w`, `gating`'s unit (the clamped one with Candle's
    /// `minimum` and `clamp`).
    fn composed_expert(x: &Tensor, w: &[Var], form: ExpertForm, gating: Gating) -> Tensor {
        let product = |w: &Var| x.matmul(&w.t().unwrap()).unwrap();
        let (gate, up, down_bias) = match form {
            ExpertForm::Separate => (product(&w[0]), product(&w[1]), None),
            ExpertForm::Interleaved => {
                let both = product(&w[0]).broadcast_add(&w[1]).unwrap();
                let width = both.dim(1).unwrap() / 2;
                let pairs = both.reshape((x.dim(0).unwrap(), width, 2)).unwrap();
                let half = |p| pairs.narrow(2, p, 1).unwrap().squeeze(2).unwrap();
                (half(0), half(1), Some(&w[3]))
            }
        };
        let mid = match gating {
            Gating::Act(Activation::Silu) => (gate.silu().unwrap() * up).unwrap(),
            Gating::Act(_) => (gate.gelu().unwrap() * up).unwrap(),
            Gating::Clamped { alpha, limit } => {
                let gate = gate.minimum(limit).unwrap();
                let up = up.clamp(-limit, limit).unwrap();
                let opened = candle_nn::ops::sigmoid(&gate.affine(alpha, 0.0).unwrap()).unwrap();
                ((up + 1.0).unwrap() * (gate * opened).unwrap()).unwrap()
            }
        };
        let out = mid.matmul(&w[DOWN].t().unwrap()).unwrap();
        match down_bias {
            Some(bias) => out.broadcast_add(bias).unwrap(),
            None => out,
        }
    }

    /// The experts composed of Candle's ops, each over its rows.
    fn composed(
        h: &Tensor,
        weights: &[Vec<Var>],
        rows: &[u32],
        ranges: &[Range<usize>],
        form: ExpertForm,
        gating: Gating,
    ) -> Tensor {
        let outs: Vec<Tensor> = weights
            .iter()
            .zip(ranges)
            .map(|(w, range)| {
                let ids = Tensor::new(&rows[range.clone()], h.device()).unwrap();
                let x = h.index_select(&ids, 0).unwrap();
                composed_expert(&x, w, form, gating)
            })
            .collect();
        Tensor::cat(&outs, 0).unwrap()
    }

    /// The largest difference of `a` from `b` over `b`'s largest value.
    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        let max = |t: &Tensor| -> f64 {
            let t = t.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            t.to_dtype(DType::F64).unwrap().to_scalar().unwrap()
        };
        max(&(a - b).unwrap()) / max(b).max(1e-30)
    }

    /// The experts' op over `vars` (hooked by `hook`, whose gradients
    /// `kept` returns) against Candle's composition over `real`: output,
    /// input gradient and every weight's gradient (zeros where the
    /// composition has none: an expert without rows) within `tolerance`.
    #[allow(clippy::too_many_arguments)]
    fn check_against_composition(
        case: &str,
        real: &[Vec<Var>],
        vars: &[Vec<Var>],
        hook: Arc<dyn GradHook>,
        kept: &dyn Fn(&Var) -> Option<Tensor>,
        (form, gating): (ExpertForm, Gating),
        dtype: DType,
        tolerance: f64,
    ) {
        // Six tokens; expert 1 takes none, expert 2 takes a token twice.
        let rows = [0u32, 3, 5, 1, 1, 2, 4, 0];
        let ranges = [0..3, 3..3, 3..5, 5..8];
        let h = Var::from_tensor(&fixed((6, 8), 100, 1.0, dtype)).unwrap();
        let probe = fixed((8, 8), 101, 1.0, dtype);
        let backward = |y: &Tensor| (y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let theirs = composed(&h, real, &rows, &ranges, form, gating);
        let their_grads = backward(&theirs);
        let experts = ExpertMlps::new(tensors(vars), form, gating, hook).unwrap();
        let ids = Tensor::new(&rows, &Device::Cpu).unwrap();
        let ours = experts.forward(&h, &ids, &ranges).unwrap();
        // The hook sees every weight behind the output, in backward order.
        let behind = vars_behind(ours.id()).expect("the weights behind the output");
        let ids: Vec<_> = vars.iter().flatten().map(|w| w.id()).collect();
        assert_eq!(*behind, ids, "{case}");
        let diff = max_diff(&ours, &theirs);
        assert!(diff < tolerance, "{case}: outputs differ by {diff:e}");
        let our_grads = backward(&ours);
        let diff = max_diff(our_grads.get(&h).unwrap(), their_grads.get(&h).unwrap());
        assert!(
            diff < tolerance,
            "{case}: input gradients differ by {diff:e}"
        );
        for (e, (ws, rs)) in vars.iter().zip(real).enumerate() {
            for (v, (w, r)) in ws.iter().zip(rs).enumerate() {
                assert!(
                    our_grads.get(w).is_none(),
                    "{case}: the hook's, not Candle's"
                );
                let ours = kept(w).expect("every expert's gradient");
                let theirs = match their_grads.get(r) {
                    Some(g) => g.clone(),
                    None => r.zeros_like().unwrap(),
                };
                let diff = max_diff(&ours, &theirs);
                assert!(
                    diff < tolerance,
                    "{case}: expert {e}'s variable {v} differs by {diff:e}"
                );
            }
        }
    }

    /// The forms and units checked: SiLU and GELU over separate
    /// projections, gpt-oss's clamped unit (a limit some values pass) over
    /// interleaved ones with biases.
    const CASES: [(ExpertForm, Gating); 3] = [
        (ExpertForm::Separate, Gating::Act(Activation::Silu)),
        (ExpertForm::Separate, Gating::Act(Activation::Gelu)),
        (
            ExpertForm::Interleaved,
            Gating::Clamped {
                alpha: 1.702,
                limit: 0.5,
            },
        ),
    ];

    /// The op's output, input gradient and every variable's gradient equal
    /// the composition's, on the CPU's own path (f32) and the tensor ops'
    /// (f64), in every form and unit, with an expert that no row reaches
    /// (its gradients present and zero).
    #[test]
    fn the_op_is_the_composition_of_candles_ops() {
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            for (form, gating) in CASES {
                // Candle's GELU backward takes its constants to six digits.
                let tolerance = match gating {
                    Gating::Act(Activation::Gelu) => f64::max(tolerance, 1e-5),
                    _ => tolerance,
                };
                let weights = weights(4, 8, 5, form, dtype);
                let collector = Arc::new(GradCollector::new());
                check_against_composition(
                    &format!("{dtype:?} {form:?} {gating:?}"),
                    &weights,
                    &weights,
                    collector.clone(),
                    &|w| collector.get(w),
                    (form, gating),
                    dtype,
                    tolerance,
                );
            }
        }
    }

    /// A hook that lends its own copy of each weight's values (the
    /// variables hold zeros), whole or in two pieces split mid-row, as
    /// stage 3 does, and keeps the gradients.
    struct Lending {
        values: std::collections::HashMap<candle_core::TensorId, Tensor>,
        in_pieces: bool,
        grads: GradCollector,
    }

    struct Dropped;

    impl crate::nn::GiveBack for Dropped {
        fn give_back(&self, _tag: usize, _storage: Storage) {}
    }

    impl GradHook for Lending {
        fn grad_ready(&self, var: &Var, grad: Tensor) -> Result<()> {
            self.grads.grad_ready(var, grad)
        }

        fn gather(&self, var: &Var, piece: usize) -> Result<Option<GatheredParam>> {
            let Some(values) = self.values.get(&var.id()) else {
                return Ok(None);
            };
            let n = values.elem_count();
            let split = if self.in_pieces { n / 2 + 1 } else { n };
            let range = match piece {
                0 => 0..split,
                1 if split < n => split..n,
                _ => return Ok(None),
            };
            let flat = values.flatten_all()?.narrow(0, range.start, range.len())?;
            let stretch = crate::nn::Stretch {
                at: 0..range.len(),
                values: range,
            };
            let storage = crate::nn::storage::owned_storage(&flat, "a lent weight")?;
            Ok(Some(GatheredParam::new(
                storage,
                vec![stretch],
                values.shape(),
                0,
                Arc::new(Dropped),
            )))
        }
    }

    /// Weights lent by the hook, whole and in pieces, on the CPU's own path
    /// (f32) and the tensor ops' (f64), are computed with as the
    /// variables' own: the variables hold zeros, so a forward or backward
    /// that read them instead would differ.
    #[test]
    fn lent_weights_are_read_whole_and_in_pieces() {
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            for (in_pieces, (form, gating)) in [
                (false, CASES[0]),
                (true, CASES[0]),
                (false, CASES[2]),
                (true, CASES[2]),
            ] {
                let real = weights(4, 8, 5, form, dtype);
                let zeroed: Vec<Vec<Var>> = real
                    .iter()
                    .map(|ws| {
                        ws.iter()
                            .map(|w| Var::zeros(w.shape(), dtype, &Device::Cpu).unwrap())
                            .collect()
                    })
                    .collect();
                let values = zeroed
                    .iter()
                    .flatten()
                    .zip(real.iter().flatten())
                    .map(|(z, r)| (z.id(), r.as_tensor().detach()))
                    .collect();
                let hook = Arc::new(Lending {
                    values,
                    in_pieces,
                    grads: GradCollector::new(),
                });
                check_against_composition(
                    &format!("{dtype:?} {form:?}, in pieces: {in_pieces}"),
                    &real,
                    &zeroed,
                    hook.clone(),
                    &|w| hook.grads.get(w),
                    (form, gating),
                    dtype,
                    tolerance,
                );
            }
        }
    }

    /// The record of the weights behind an output goes with the graph.
    #[test]
    fn the_weights_behind_are_forgotten_with_the_graph() {
        let weights = weights(2, 8, 5, ExpertForm::Separate, DType::F32);
        let hook: Arc<dyn GradHook> = Arc::new(GradCollector::new());
        let silu = Gating::Act(Activation::Silu);
        let experts = ExpertMlps::new(tensors(&weights), ExpertForm::Separate, silu, hook).unwrap();
        let h = Var::from_tensor(&fixed((3, 8), 7, 1.0, DType::F32)).unwrap();
        let rows = Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap();
        let out = experts.forward(&h, &rows, &[0..2, 2..3]).unwrap();
        let id = out.id();
        assert_eq!(vars_behind(id).map(|v| v.len()), Some(6));
        drop(out);
        assert!(vars_behind(id).is_none());
    }

    #[test]
    fn mismatched_shapes_and_ranges_are_errors() {
        let collector: Arc<dyn GradHook> = Arc::new(GradCollector::new());
        let mut ws = tensors(&weights(2, 8, 5, ExpertForm::Separate, DType::F32));
        let (form, silu) = (ExpertForm::Separate, Gating::Act(Activation::Silu));
        let experts = ExpertMlps::new(ws.clone(), form, silu, collector.clone()).unwrap();
        let h = Tensor::zeros((3, 8), DType::F32, &Device::Cpu).unwrap();
        let rows = Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap();
        let err = experts.forward(&h, &rows, &[0..1, 1..2, 2..3]).unwrap_err();
        assert!(err.to_string().contains("3 row ranges"), "{err}");
        let err = experts.forward(&h, &rows, &[0..1, 2..3]).unwrap_err();
        assert!(err.to_string().contains("one range, in order"), "{err}");
        ws[1][2] = Tensor::zeros((8, 4), DType::F32, &Device::Cpu).unwrap();
        let err = ExpertMlps::new(ws.clone(), form, silu, collector.clone())
            .err()
            .expect("a narrower down projection");
        assert!(err.to_string().contains("expert 1's"), "{err}");
        let err = ExpertMlps::new(ws, ExpertForm::Interleaved, silu, collector)
            .err()
            .expect("separate projections read as interleaved ones");
        assert!(err.to_string().contains("Interleaved"), "{err}");
    }
}
