//! The gradient hook: how a layer hands a parameter's gradient out of Candle's backward.

use super::storage::OnDevice;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::backprop::GradStore;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, Device, Layout, Result, Shape, Storage, Tensor, TensorId,
    Var,
};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

/// Receives parameter gradients during `loss.backward()`, the moment each is
/// computed.
///
/// The layers of [`crate::nn`] call [`GradHook::grad_ready`] from inside
/// Candle's backward pass, once per use of a variable in the graph, with the
/// gradient of that use. A variable used once (the usual case) gets exactly
/// one call, carrying its complete gradient; a variable used by `k` hooked
/// ops (a tied weight) gets `k` calls whose sum is its gradient, the last of
/// them at the variable's place in `loss.sorted_nodes()`.
///
/// Gradients handed to a hook are **not** in the `GradStore` that
/// `backward()` returns. An error returned here aborts the backward pass and
/// comes out of `backward()`.
///
/// Closures `Fn(&Var, Tensor) -> candle_core::Result<()>` are hooks:
///
/// ```
/// use std::sync::Arc;
/// use zero_candle::nn::GradHook;
/// let hook: Arc<dyn GradHook> = Arc::new(|var: &candle_core::Var, grad: candle_core::Tensor| {
///     println!("{:?} ready: {:?}", var.id(), grad.shape());
///     Ok(())
/// });
/// # let _ = hook;
/// ```
pub trait GradHook: Send + Sync {
    /// `grad` is (a use's share of) the gradient of `var`: same shape and
    /// dtype as `var`, contiguous, on its device. Called on the thread that
    /// runs `backward()`, in the order backward computes the gradients.
    fn grad_ready(&self, var: &Var, grad: Tensor) -> Result<()>;

    /// How many bytes of a weight's gradient the hook takes at a time, if
    /// it takes gradients in blocks of rows ([`GradHook::grad_block_ready`]);
    /// `None` (the default): whole gradients, through
    /// [`GradHook::grad_ready`]. A layer that can compute a weight gradient
    /// a block of rows at a time (Linear) then never holds it whole.
    fn block_bytes(&self) -> Option<usize> {
        None
    }

    /// Rows `rows` of (a use's share of) the gradient of `var`: `grad` is
    /// `[rows.len(), ..]` with `var`'s other dims, contiguous. Called only
    /// when [`GradHook::block_bytes`] is `Some`; one use's blocks come one
    /// after another, in row order, and cover every row once. The default
    /// takes a block that is the whole gradient and refuses others.
    fn grad_block_ready(&self, var: &Var, rows: Range<usize>, grad: Tensor) -> Result<()> {
        if rows.start == 0 && grad.dims() == var.dims() {
            return self.grad_ready(var, grad);
        }
        candle_core::bail!(
            "this gradient hook takes whole gradients: its block_bytes must be None (it got \
             rows {rows:?} of a {:?} gradient)",
            var.dims()
        )
    }

    /// Told once per layer built with this hook, for each of the layer's
    /// parameters that is a variable: the layer will report that variable's
    /// gradient once per use. A hook that reduces gradients during backward
    /// uses it to know, before the first backward, which gradients will
    /// come (no warm-up step). The default ignores it.
    fn will_report(&self, var: &Var) {
        let _ = var;
    }

    /// Told once per layer that can compute with a parameter it does not
    /// hold ([`GradHook::gather`]): `var` may then be sharded (ZeRO stage
    /// 3). The default ignores it.
    fn will_gather(&self, var: &Var) {
        let _ = var;
    }

    /// Called by a layer's forward before it reads `var`'s values. A hook
    /// whose optimizer brings the parameters up to date in the background
    /// (deferred all-gathers after a step) waits here until `var` holds the
    /// last step's values. The default returns at once; a hook that wraps
    /// another must pass this on, or its layers may read stale values.
    fn before_read(&self, var: &Var) -> Result<()> {
        let _ = var;
        Ok(())
    }

    /// Piece `piece` of the full values of `var` when the hook keeps it
    /// sharded (ZeRO stage 3: the variable's own storage is then empty),
    /// lent for one computation; `None` when the variable holds its values
    /// or has no such piece. A layer gathered whole comes in one piece
    /// ([`GatheredParam::whole`]); a larger one in several, each a few
    /// stretches of its values, so that it never exists whole. Layers that
    /// announced `var` with [`GradHook::will_gather`] ask for pieces 0, 1,
    /// ... until `None` in their forward (and backward, if it needs the
    /// weight), dropping each as soon as they are done with it. The
    /// default keeps nothing sharded.
    fn gather(&self, var: &Var, piece: usize) -> Result<Option<GatheredParam>> {
        let _ = (var, piece);
        Ok(None)
    }
}

/// Variables whose gradients an op's backward hands to the hook although
/// they are not its inputs (a checkpointed block's, a mixture's experts'),
/// by the id of the op's output, in the order it hands them over: where
/// `loss.sorted_nodes()` cannot see them, and the hook must predict them.
fn behind_registry() -> &'static Mutex<HashMap<TensorId, Arc<Vec<TensorId>>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<TensorId, Arc<Vec<TensorId>>>>> = OnceLock::new();
    REGISTRY.get_or_init(Mutex::default)
}

/// The variables behind the op whose output is `node` ([`Behind`]), in
/// backward order; `None` for any other node.
pub(crate) fn vars_behind(node: TensorId) -> Option<Arc<Vec<TensorId>>> {
    behind_registry()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&node)
        .cloned()
}

/// An op's record of the variables behind its output (see
/// [`vars_behind`]), kept by the op: made before the op runs, placed once
/// its output exists, forgotten when the op (its graph) goes.
#[derive(Default)]
pub(crate) struct Behind(Mutex<Option<TensorId>>);

impl Behind {
    /// Records `vars` behind `output`.
    pub(crate) fn place(&self, output: TensorId, vars: Arc<Vec<TensorId>>) {
        behind_registry()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(output, vars);
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(output);
    }
}

impl Drop for Behind {
    fn drop(&mut self) {
        let placed = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(id) = placed {
            behind_registry()
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id);
        }
    }
}

/// Takes back the storage a [`GatheredParam`] lent.
pub trait GiveBack: Send + Sync {
    /// `storage` (as lent) of gather `tag` (the lender's own number) is
    /// free again.
    fn give_back(&self, tag: usize, storage: Storage);
}

/// A stretch of a parameter's values in a [`GatheredParam`]'s storage:
/// `at` (elements of the storage) holds the parameter's row-major elements
/// `values`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stretch {
    /// Elements of the storage.
    pub at: Range<usize>,
    /// Their places in the parameter.
    pub values: Range<usize>,
}

/// A piece of the full values of a sharded parameter (all of them when it
/// is gathered whole), lent by a [`GradHook`] for one computation: a
/// storage (on the parameter's device) and where the parameter's values lie
/// in it. The storage goes back to the lender when this is dropped.
pub struct GatheredParam {
    storage: Option<Storage>,
    stretches: Arc<[Stretch]>,
    /// The parameter's layout in the storage, when the piece is all of it.
    whole: Option<Layout>,
    tag: usize,
    lender: Arc<dyn GiveBack>,
}

impl GatheredParam {
    /// Lends `storage`, holding `stretches` of a parameter of shape
    /// `shape`; `lender` receives it back (with `tag`) when the borrower is
    /// done.
    pub fn new(
        storage: Storage,
        stretches: impl Into<Arc<[Stretch]>>,
        shape: &Shape,
        tag: usize,
        lender: Arc<dyn GiveBack>,
    ) -> Self {
        let stretches = stretches.into();
        let whole = match &*stretches {
            [one] if one.values == (0..shape.elem_count()) => {
                Some(Layout::contiguous_with_offset(shape, one.at.start))
            }
            _ => None,
        };
        Self {
            storage: Some(storage),
            stretches,
            whole,
            tag,
            lender,
        }
    }

    /// The storage and the parameter's layout in it, when this piece holds
    /// the whole parameter.
    pub fn whole(&self) -> Option<(&Storage, &Layout)> {
        Some((self.storage.as_ref()?, self.whole.as_ref()?))
    }

    /// [`GatheredParam::whole`] as backend storage `S` (`None` as well when
    /// the piece is on another device).
    pub(crate) fn whole_on<S: OnDevice>(&self) -> Option<(&S, &Layout)> {
        let (storage, layout) = self.whole()?;
        Some((S::of(storage)?, layout))
    }

    /// The stretches of the parameter this piece holds.
    pub fn stretches(&self) -> &[Stretch] {
        &self.stretches
    }

    /// The storage the stretches lie in.
    pub fn storage(&self) -> &Storage {
        self.storage
            .as_ref()
            .expect("the storage is only taken when dropped")
    }

    /// Elements `at` of the storage as a 1-d tensor on `device` (a copy).
    pub fn tensor(&self, at: Range<usize>, device: &Device) -> Result<Tensor> {
        match self.storage() {
            Storage::Cpu(storage) => {
                if at.end > super::cpu::storage_len(storage) {
                    candle_core::bail!("a gathered piece has no elements {at:?}")
                }
                match storage {
                    CpuStorage::F32(v) => Tensor::from_slice(&v[at.clone()], at.len(), device),
                    CpuStorage::F64(v) => Tensor::from_slice(&v[at.clone()], at.len(), device),
                    CpuStorage::BF16(v) => Tensor::from_slice(&v[at.clone()], at.len(), device),
                    CpuStorage::F16(v) => Tensor::from_slice(&v[at.clone()], at.len(), device),
                    other => candle_core::bail!(
                        "a gathered parameter of dtype {:?}: stage 3 gathers f32, f64, bf16 or f16",
                        other.dtype()
                    ),
                }
            }
            Storage::Cuda(storage) => {
                let copy = cuda_range(storage, at.clone())?;
                let copy = super::storage::tensor_from(Storage::Cuda(copy), at.len());
                copy.to_device(device)
            }
            Storage::Metal(_) => candle_core::bail!("stage 3 gathers on the CPU or CUDA only"),
        }
    }
}

/// Elements `at` of a CUDA storage, copied into a new one (on the same
/// stream: no host wait).
fn cuda_range(storage: &CudaStorage, at: Range<usize>) -> Result<CudaStorage> {
    let mut copy = storage
        .device()
        .zeros_impl(&Shape::from(at.len()), storage.dtype())?;
    let from = Layout::contiguous_with_offset(at.len(), at.start);
    storage.copy_strided_src(&mut copy, 0, &from)?;
    Ok(copy)
}

impl Drop for GatheredParam {
    fn drop(&mut self) {
        if let Some(storage) = self.storage.take() {
            self.lender.give_back(self.tag, storage);
        }
    }
}

impl std::fmt::Debug for GatheredParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatheredParam")
            .field("stretches", &self.stretches)
            .field("whole", &self.whole.is_some())
            .finish()
    }
}

/// Tells `hook` (if any) that a layer can compute with those of `params`
/// that are variables without holding them (they may be sharded).
pub(crate) fn announce_gather(hook: Option<&Arc<dyn GradHook>>, params: &[Option<&Tensor>]) {
    let Some(hook) = hook else { return };
    for param in params.iter().flatten() {
        if param.is_variable() {
            if let Ok(var) = Var::from_tensor(param) {
                hook.will_gather(&var);
            }
        }
    }
}

/// [`GradHook::before_read`] for each of `params` that is a variable.
pub(crate) fn before_read(
    hook: Option<&Arc<dyn GradHook>>,
    params: &[Option<&Tensor>],
) -> Result<()> {
    let Some(hook) = hook else {
        return Ok(());
    };
    for param in params.iter().flatten() {
        if param.is_variable() {
            hook.before_read(&Var::from_tensor(param)?)?;
        }
    }
    Ok(())
}

/// Piece `piece` of the full values of `param` if the hook keeps it
/// sharded (`None` past the last piece). `None` for piece 0: the layer
/// reads `param` itself, an error if it holds no values
/// ([`check_holds_values`]).
pub(crate) fn gather(
    hook: Option<&Arc<dyn GradHook>>,
    param: Option<&Tensor>,
    piece: usize,
) -> Result<Option<GatheredParam>> {
    let gathered = match (hook, param) {
        (Some(hook), Some(param)) if param.is_variable() => {
            hook.gather(&Var::from_tensor(param)?, piece)?
        }
        _ => None,
    };
    if gathered.is_none() && piece == 0 {
        check_holds_values(&[param])?;
    }
    Ok(gathered)
}

/// An error for the first of `params` whose storage holds fewer values
/// than its shape (Candle's kernels would read past it): a variable a
/// [`crate::ShardedVarMap`] created deferred, read before the optimizer
/// filled it, or a stage-3 shard read without the optimizer's hook.
pub(crate) fn check_holds_values(params: &[Option<&Tensor>]) -> Result<()> {
    match params.iter().flatten().find(|p| !crate::holds_values(p)) {
        Some(param) => candle_core::bail!(
            "zero-candle: a parameter {:?} holds no values yet: a ShardedVarMap's variables are \
             filled by ZeroOptimizer::new_sharded (at stage 3 each rank's shard only, which the \
             layers gather through the optimizer's hook); build the optimizer before the first \
             forward and give the layers its hook, or call ShardedVarMap::materialize_all",
            param.dims()
        ),
        None => Ok(()),
    }
}

/// One stretch of a parameter's values, as [`for_each_stretch`] lends it:
/// in a gathered piece, or the parameter's own values.
pub(crate) enum StretchView<'a> {
    Piece {
        piece: &'a GatheredParam,
        at: Range<usize>,
    },
    Own(Tensor),
}

impl StretchView<'_> {
    /// Elements `range` of the stretch as a 1-d tensor (a copy from a
    /// piece).
    pub(crate) fn tensor(&self, range: Range<usize>, device: &Device) -> Result<Tensor> {
        match self {
            Self::Piece { piece, at } => {
                piece.tensor(at.start + range.start..at.start + range.end, device)
            }
            Self::Own(values) => values.narrow(0, range.start, range.len()),
        }
    }

    /// `lhs·B`, where `B` is the `[rows, cols]` row-major block of the
    /// stretch at element `offset`, transposed when `transpose`: read in
    /// place from a piece.
    pub(crate) fn matmul(
        &self,
        lhs: &Tensor,
        offset: usize,
        (rows, cols): (usize, usize),
        transpose: bool,
    ) -> Result<Tensor> {
        let lhs = &gemm_operand(lhs.clone())?;
        match self {
            Self::Piece { piece, at } => {
                let block = Layout::contiguous_with_offset((rows, cols), at.start + offset);
                let layout = if transpose {
                    block.transpose(0, 1)?
                } else {
                    block
                };
                lhs.apply_op1_no_bwd(&BlockMatmul {
                    storage: piece.storage(),
                    layout,
                })
            }
            Self::Own(values) => {
                let block = values
                    .narrow(0, offset, rows * cols)?
                    .reshape((rows, cols))?;
                let block = if transpose { block.t()? } else { block };
                lhs.matmul(&block)
            }
        }
    }
}

/// `t` as a matrix product takes it: on the CPU with any strides, elsewhere
/// contiguous (Candle's CUDA product reads rows of `k` adjacent elements).
pub(crate) fn gemm_operand(t: Tensor) -> Result<Tensor> {
    if t.device().is_cpu() {
        Ok(t)
    } else {
        t.contiguous()
    }
}

/// `lhs·B` with `B` read in place from a storage at `layout` (`[k, n]`).
struct BlockMatmul<'a> {
    storage: &'a Storage,
    layout: Layout,
}

impl BlockMatmul<'_> {
    fn product<S: OnDevice>(&self, lhs: &S, lhs_layout: &Layout) -> Result<(S, Shape)> {
        let (m, k) = lhs_layout.shape().dims2()?;
        let (rhs_k, n) = self.layout.shape().dims2()?;
        if k != rhs_k {
            candle_core::bail!("zero-candle: a block product of [{m}, {k}] by [{rhs_k}, {n}]")
        }
        let Some(rhs) = S::of(self.storage) else {
            candle_core::bail!(
                "zero-candle: a gathered piece on another device than the layer's input; keep \
                 the model and its inputs on one device"
            )
        };
        let product = lhs.matmul(rhs, (1, m, n, k), lhs_layout, &self.layout)?;
        Ok((product, Shape::from((m, n))))
    }
}

impl CustomOp1 for BlockMatmul<'_> {
    fn name(&self) -> &'static str {
        "zero-block-matmul"
    }

    fn cpu_fwd(&self, lhs: &CpuStorage, lhs_layout: &Layout) -> Result<(CpuStorage, Shape)> {
        self.product(lhs, lhs_layout)
    }

    fn cuda_fwd(&self, lhs: &CudaStorage, lhs_layout: &Layout) -> Result<(CudaStorage, Shape)> {
        self.product(lhs, lhs_layout)
    }
}

/// Calls `f(values, stretch)` for every stretch of `param`'s values (their
/// places in the row-major parameter, and the values): a piece at a time
/// from `first` (piece 0 of its gather) on, each piece given back before
/// the next is asked for; or, with no `first`, once for the whole
/// parameter as it is.
pub(crate) fn for_each_stretch(
    hook: Option<&Arc<dyn GradHook>>,
    param: &Tensor,
    first: Option<GatheredParam>,
    mut f: impl FnMut(Range<usize>, &StretchView) -> Result<()>,
) -> Result<()> {
    let Some(first) = first else {
        let own = StretchView::Own(param.detach().flatten_all()?);
        return f(0..param.elem_count(), &own);
    };
    let mut piece = Some(first);
    let mut next = 0;
    while let Some(gathered) = piece {
        for stretch in gathered.stretches() {
            let view = StretchView::Piece {
                piece: &gathered,
                at: stretch.at.clone(),
            };
            f(stretch.values.clone(), &view)?;
        }
        drop(gathered);
        next += 1;
        piece = gather(hook, Some(param), next)?;
    }
    Ok(())
}

/// `param`'s whole values (shaped as `param`), assembled from its pieces
/// as [`for_each_stretch`] visits them.
pub(crate) fn assemble(
    hook: Option<&Arc<dyn GradHook>>,
    param: &Tensor,
    first: Option<GatheredParam>,
) -> Result<Tensor> {
    let mut parts = Vec::new();
    for_each_stretch(hook, param, first, |values, stretch| {
        parts.push((
            values.start,
            stretch.tensor(0..values.len(), param.device())?,
        ));
        Ok(())
    })?;
    parts.sort_by_key(|(start, _)| *start);
    let parts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
    Tensor::cat(&parts, 0)?.reshape(param.shape())
}

/// A part of a row-major `[rows, row_len]` matrix that a stretch of its
/// elements covers, at element `at` of the stretch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RowPart {
    /// Whole rows.
    Rows { rows: Range<usize>, at: usize },
    /// Columns `cols` of one row.
    Partial {
        row: usize,
        cols: Range<usize>,
        at: usize,
    },
}

/// The parts of a `row_len`-wide matrix that its elements `values` cover:
/// a partial row at either end, whole rows between.
pub(crate) fn row_parts(values: Range<usize>, row_len: usize) -> Vec<RowPart> {
    let mut parts = Vec::new();
    let mut pos = values.start;
    while pos < values.end && row_len > 0 {
        let (row, col) = (pos / row_len, pos % row_len);
        let at = pos - values.start;
        let whole = (values.end - pos) / row_len;
        if col == 0 && whole > 0 {
            parts.push(RowPart::Rows {
                rows: row..row + whole,
                at,
            });
            pos += whole * row_len;
        } else {
            let end = row_len.min(col + values.end - pos);
            parts.push(RowPart::Partial {
                row,
                cols: col..end,
                at,
            });
            pos += end - col;
        }
    }
    parts
}

impl<F> GradHook for F
where
    F: Fn(&Var, Tensor) -> Result<()> + Send + Sync,
{
    fn grad_ready(&self, var: &Var, grad: Tensor) -> Result<()> {
        self(var, grad)
    }
}

/// Tells `hook` (if any) that a layer will report the gradients of those of
/// `params` that are variables.
pub(crate) fn announce(hook: Option<&Arc<dyn GradHook>>, params: &[Option<&Tensor>]) {
    let Some(hook) = hook else { return };
    for param in params.iter().flatten() {
        if param.is_variable() {
            if let Ok(var) = Var::from_tensor(param) {
                hook.will_report(&var);
            }
        }
    }
}

/// Sends the gradient `grad` of the op argument `param` where it belongs: to
/// the hook when there is one and `param` is a variable (the op then returns
/// `None` for it, leaving no `GradStore` entry), otherwise back to Candle.
///
/// A hooked op whose parameter is not itself a variable (say a transposed
/// view of one) still works: Candle carries the gradient on to the variable.
pub(crate) fn route(
    hook: Option<&Arc<dyn GradHook>>,
    param: &Tensor,
    grad: Tensor,
) -> Result<Option<Tensor>> {
    match hook {
        Some(hook) if param.is_variable() => {
            // The promise to hooks is a contiguous gradient; upstream
            // gradients can be broadcast views (the gradient of a sum).
            let grad = grad.contiguous()?;
            hook.grad_ready(&Var::from_tensor(param)?, grad)?;
            Ok(None)
        }
        _ => Ok(Some(grad)),
    }
}

/// [`route`] for a gradient the op can compute a block of rows at a time
/// (`compute(rows)`): to a hook that takes blocks, in the blocks
/// `blocks(block_bytes)` names, each handed over as it is computed, so the
/// whole gradient never exists; otherwise whole.
pub(crate) fn route_blocks(
    hook: Option<&Arc<dyn GradHook>>,
    param: &Tensor,
    blocks: impl FnOnce(usize) -> Vec<Range<usize>>,
    mut compute: impl FnMut(Range<usize>) -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    let rows = param.dim(0)?;
    match hook {
        Some(hook) if param.is_variable() => match hook.block_bytes() {
            Some(bytes) => {
                let var = Var::from_tensor(param)?;
                for block in blocks(bytes) {
                    let grad = compute(block.clone())?.contiguous()?;
                    hook.grad_block_ready(&var, block, grad)?;
                }
                Ok(None)
            }
            None => route(Some(hook), param, compute(0..rows)?),
        },
        _ => Ok(Some(compute(0..rows)?)),
    }
}

/// A [`GradHook`] that keeps the gradients it receives, summing the calls
/// for one variable, so that the existing `ZeroOptimizer::step(&GradStore)`
/// can consume them after backward (no overlap).
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use zero_candle::nn::{self, GradCollector, GradHook};
///
/// # fn main() -> candle_core::Result<()> {
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let collector = Arc::new(GradCollector::new());
/// let hook: Arc<dyn GradHook> = collector.clone();
/// let layer = nn::linear(4, 2, vb.pp("fc"), Some(hook))?;
///
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let mut grads = layer.forward(&x)?.sum_all()?.backward()?;
/// collector.merge_into(&mut grads)?; // now grads holds fc.weight and fc.bias
/// # assert_eq!(grads.get_ids().count(), 2);
/// # Ok(())
/// # }
/// ```
#[derive(Default)]
pub struct GradCollector {
    collected: Mutex<Collected>,
}

/// The gradients received so far, in order of first arrival.
#[derive(Default)]
struct Collected {
    position: HashMap<TensorId, usize>,
    grads: Vec<(Var, Tensor)>,
}

impl GradCollector {
    /// An empty collector. Share it as `Arc<GradCollector>` and pass a clone
    /// of that `Arc` as each layer's hook.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Collected> {
        // Every change to `Collected` is one insert or one replace made after
        // the fallible work, so a panic elsewhere leaves it consistent.
        self.collected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The gradient collected for `var` so far (the sum of its calls).
    pub fn get(&self, var: &Var) -> Option<Tensor> {
        let collected = self.lock();
        let position = *collected.position.get(&var.id())?;
        Some(collected.grads[position].1.clone())
    }

    /// How many variables have a gradient.
    pub fn len(&self) -> usize {
        self.lock().grads.len()
    }

    /// Whether no variable has a gradient.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes the gradients, in the order the variables first got one.
    pub fn drain(&self) -> Vec<(Var, Tensor)> {
        let mut collected = self.lock();
        collected.position.clear();
        std::mem::take(&mut collected.grads)
    }

    /// Removes the gradients into a new `GradStore`, keyed by variable as
    /// `loss.backward()`'s is.
    pub fn take(&self) -> GradStore {
        let mut store = GradStore::default();
        for (var, grad) in self.drain() {
            store.insert(var.as_tensor(), grad);
        }
        store
    }

    /// Removes the gradients and adds them to `grads` (typically what
    /// `loss.backward()` returned): a variable already there gets the sum,
    /// which covers a weight used both by a hooked layer and by a plain op.
    pub fn merge_into(&self, grads: &mut GradStore) -> Result<()> {
        grads.extend(self.take())
    }
}

impl GradHook for GradCollector {
    fn grad_ready(&self, var: &Var, grad: Tensor) -> Result<()> {
        let mut collected = self.lock();
        match collected.position.get(&var.id()).copied() {
            Some(position) => {
                let sum = collected.grads[position].1.add(&grad)?;
                collected.grads[position].1 = sum;
            }
            None => {
                let position = collected.grads.len();
                collected.position.insert(var.id(), position);
                collected.grads.push((var.clone(), grad));
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for GradCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let collected = self.lock();
        f.debug_struct("GradCollector")
            .field(
                "grads",
                &collected
                    .grads
                    .iter()
                    .map(|(var, grad)| (var.id(), grad.shape().clone()))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{row_parts, RowPart};

    #[test]
    fn a_stretch_splits_into_partial_rows_at_its_ends_and_whole_rows_between() {
        use RowPart::{Partial, Rows};
        // Rows of 4: elements 2..15 are the end of row 0, rows 1 and 2,
        // and the start of row 3.
        assert_eq!(
            row_parts(2..15, 4),
            vec![
                Partial {
                    row: 0,
                    cols: 2..4,
                    at: 0
                },
                Rows { rows: 1..3, at: 2 },
                Partial {
                    row: 3,
                    cols: 0..3,
                    at: 10
                },
            ]
        );
        // Inside one row; exactly whole rows; nothing.
        assert_eq!(
            row_parts(5..7, 4),
            vec![Partial {
                row: 1,
                cols: 1..3,
                at: 0
            }]
        );
        assert_eq!(row_parts(8..16, 4), vec![Rows { rows: 2..4, at: 0 }]);
        assert_eq!(row_parts(3..3, 4), vec![]);
    }
}
