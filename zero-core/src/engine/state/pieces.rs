//! The pieces of a checkpoint as they travel: what each rank says about
//! its optimizer pieces (`PieceMeta`), where the receiver puts them (a
//! `PieceSink`: in memory or straight into a file), the model file rank 0
//! streams, and the assembly of a rank's state from saved pieces.

use crate::checkpoint::stream::StreamingTensorFile;
use crate::checkpoint::{checkpoint_error, FileRecord, PieceRecord, TensorBytes, TensorWriter};
use crate::optim::ParamState;
use crate::{DType, Element, Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// What a rank tells the receiver about one piece before sending its state.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(in crate::engine) struct PieceMeta {
    pub name: String,
    pub offset: usize,
    pub len: usize,
    /// Scalars as `f64::to_bits`, so they cross JSON exactly.
    pub scalars: Vec<(String, u64)>,
    /// Names of the element-wise tensors, in the order they are sent.
    pub tensors: Vec<String>,
    /// Set when an exported tensor is not as long as the piece.
    pub bad_len: Option<usize>,
}

/// A rank's outcome of a step of a save or load, shared with every rank.
#[derive(Serialize, Deserialize)]
pub(in crate::engine) struct RankStatus {
    pub error: Option<String>,
    pub files: Vec<(String, FileRecord)>,
}

/// What the receiver of a consolidation does with the pieces.
pub(in crate::engine) trait PieceSink<T> {
    /// Called once with every rank's piece list, before any data.
    fn begin(&mut self, all: &[Vec<PieceMeta>]) -> Result<()>;
    /// One piece's tensors, concatenated in `meta.tensors` order.
    fn piece(&mut self, meta: &PieceMeta, data: &[T]) -> Result<()>;
}

/// Coverage bookkeeping shared by both sinks: elements received per
/// parameter, checked against its length at the end.
pub(in crate::engine) fn check_coverage(
    numel: &BTreeMap<String, usize>,
    covered: &BTreeMap<String, usize>,
) -> Result<()> {
    for (name, &got) in covered {
        let want = numel.get(name).copied().unwrap_or(0);
        if got != want {
            return Err(Error::State(format!(
                "consolidation: the state of parameter {name:?} covers {got} of its {want} elements; \
                 the ranks' optimizer states are inconsistent"
            )));
        }
    }
    Ok(())
}

pub(in crate::engine) fn check_meta(
    numel: &BTreeMap<String, usize>,
    meta: &PieceMeta,
) -> Result<usize> {
    let total = numel.get(&meta.name).copied().ok_or_else(|| {
        Error::State(format!(
            "consolidation: a rank holds state for {:?}, which is not a parameter of the model",
            meta.name
        ))
    })?;
    if let Some(bad) = meta.bad_len {
        return Err(Error::State(format!(
            "consolidation: a state tensor of the piece of {:?} at {} has {bad} elements, the piece {}",
            meta.name, meta.offset, meta.len
        )));
    }
    if meta.offset + meta.len > total {
        return Err(Error::State(format!(
            "consolidation: piece {}..{} of {:?} is outside its {total} elements",
            meta.offset,
            meta.offset + meta.len,
            meta.name
        )));
    }
    Ok(total)
}

/// Assembles the pieces into full tensors in memory.
pub(in crate::engine) struct MemorySink<'a, T> {
    pub numel: &'a BTreeMap<String, usize>,
    pub state: BTreeMap<String, ParamState<T>>,
    pub covered: BTreeMap<String, usize>,
}

impl<T: Element> PieceSink<T> for MemorySink<'_, T> {
    fn begin(&mut self, _all: &[Vec<PieceMeta>]) -> Result<()> {
        Ok(())
    }

    fn piece(&mut self, meta: &PieceMeta, data: &[T]) -> Result<()> {
        let total = check_meta(self.numel, meta)?;
        let entry = self
            .state
            .entry(meta.name.clone())
            .or_insert_with(|| ParamState {
                scalars: meta
                    .scalars
                    .iter()
                    .map(|(n, bits)| (n.clone(), f64::from_bits(*bits)))
                    .collect(),
                tensors: meta
                    .tensors
                    .iter()
                    .map(|n| (n.clone(), vec![T::default(); total]))
                    .collect(),
            });
        for (i, tensor) in meta.tensors.iter().enumerate() {
            let dst = entry.tensors.get_mut(tensor).ok_or_else(|| {
                Error::State(format!(
                    "consolidation: pieces of {:?} disagree on their state tensors ({tensor:?})",
                    meta.name
                ))
            })?;
            dst[meta.offset..meta.offset + meta.len]
                .copy_from_slice(&data[i * meta.len..(i + 1) * meta.len]);
        }
        *self.covered.entry(meta.name.clone()).or_default() += meta.len;
        Ok(())
    }
}

/// Writes the pieces straight into the consolidated file as they arrive.
pub(in crate::engine) struct FileSink<'a> {
    pub numel: &'a BTreeMap<String, usize>,
    pub path: &'a Path,
    pub dtype: DType,
    pub file: Option<StreamingTensorFile>,
    pub covered: BTreeMap<String, usize>,
}

impl<T: Element> PieceSink<T> for FileSink<'_> {
    fn begin(&mut self, all: &[Vec<PieceMeta>]) -> Result<()> {
        let mut specs: BTreeMap<String, (DType, Vec<usize>)> = BTreeMap::new();
        let mut scalars: BTreeMap<String, f64> = BTreeMap::new();
        for meta in all.iter().flatten() {
            let total = check_meta(self.numel, meta)?;
            for t in &meta.tensors {
                specs.insert(
                    crate::checkpoint::consolidated_name(&meta.name, t),
                    (self.dtype, vec![total]),
                );
            }
            for (s, bits) in &meta.scalars {
                let name = crate::checkpoint::consolidated_name(&meta.name, s);
                specs.insert(name.clone(), (DType::F64, Vec::new()));
                scalars.entry(name).or_insert(f64::from_bits(*bits));
            }
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::Io {
                path: dir.to_path_buf(),
                source: e,
            })?;
        }
        let specs: Vec<(String, DType, Vec<usize>)> =
            specs.into_iter().map(|(n, (d, s))| (n, d, s)).collect();
        let mut file = StreamingTensorFile::create(self.path, &specs)?;
        for (name, value) in scalars {
            file.write_at(&name, 0, bytemuck::bytes_of(&value))?;
        }
        self.file = Some(file);
        Ok(())
    }

    fn piece(&mut self, meta: &PieceMeta, data: &[T]) -> Result<()> {
        check_meta(self.numel, meta)?;
        let file = self
            .file
            .as_mut()
            .ok_or_else(|| checkpoint_error(self.path, "internal: file not created"))?;
        for (i, tensor) in meta.tensors.iter().enumerate() {
            file.write_at(
                &crate::checkpoint::consolidated_name(&meta.name, tensor),
                meta.offset,
                bytemuck::cast_slice(&data[i * meta.len..(i + 1) * meta.len]),
            )?;
        }
        *self.covered.entry(meta.name.clone()).or_default() += meta.len;
        Ok(())
    }
}

/// Rank 0's side of a streamed model file: the first failure is kept and
/// what comes after it is let go, so that rank 0 keeps taking part in the
/// gathers while the other ranks send.
pub(in crate::engine) struct ModelFile<'a, T> {
    pub sink: Option<ModelSink<'a, T>>,
    pub failure: Option<Error>,
}

impl<T> Default for ModelFile<'_, T> {
    fn default() -> Self {
        Self {
            sink: None,
            failure: None,
        }
    }
}

/// Where rank 0 puts the model file's data.
pub(in crate::engine) enum ModelSink<'a, T> {
    /// Straight into the file (a blocking save).
    File(Box<TensorWriter>),
    /// Into host memory as long as the file's data, filled in order from
    /// `at` (a background save's snapshot; the writer thread puts the same
    /// bytes into the same file).
    Memory { values: &'a mut [T], at: usize },
}

impl<T: Element> ModelFile<'_, T> {
    pub fn write(&mut self, values: &[T]) {
        match self.sink.as_mut() {
            Some(ModelSink::File(writer)) => {
                if let Err(e) = writer.write(bytemuck::cast_slice(values)) {
                    self.fail(e);
                }
            }
            Some(ModelSink::Memory { values: to, at }) => {
                let (end, len) = (*at + values.len(), to.len());
                if let Some(to) = to.get_mut(*at..end) {
                    to.copy_from_slice(values);
                    *at = end;
                } else {
                    self.fail(Error::State(format!(
                        "internal: the model's snapshot holds {len} elements, {end} were written"
                    )));
                }
            }
            None => {}
        }
    }

    pub fn zeros(&mut self, mut count: usize) {
        let zeros = [T::default(); 1024];
        while count > 0 && self.sink.is_some() {
            let n = count.min(zeros.len());
            self.write(&zeros[..n]);
            count -= n;
        }
    }

    /// Where a snapshot's next `len` elements go, to be read straight into
    /// (`None` for a file, or once failed).
    pub fn next_in_memory(&mut self, len: usize) -> Option<&mut [T]> {
        match self.sink.as_mut() {
            Some(ModelSink::Memory { values, at }) => {
                let start = *at;
                *at += len;
                values.get_mut(start..start + len)
            }
            _ => None,
        }
    }

    /// Keeps the first failure; dropping the writer removes its temporary
    /// file.
    pub fn fail(&mut self, e: Error) {
        self.sink = None;
        self.failure.get_or_insert(e);
    }

    /// The file's record where it was written, `None` elsewhere (and where
    /// the data went into memory).
    pub fn finish(self) -> Result<Option<FileRecord>> {
        match (self.failure, self.sink) {
            (Some(e), _) => Err(e),
            (None, Some(ModelSink::File(writer))) => (*writer).finish().map(Some),
            (None, Some(ModelSink::Memory { values, at })) if at != values.len() => {
                Err(Error::State(format!(
                    "internal: the model's snapshot holds {} elements, {at} were written",
                    values.len()
                )))
            }
            (None, Some(ModelSink::Memory { .. }) | None) => Ok(None),
        }
    }
}

/// One owned piece's optimizer state, assembled from the saved pieces that
/// overlap it (a checkpoint of another world size or partition).
pub(in crate::engine) struct Assembly<T> {
    pub name: String,
    pub range: Range<usize>,
    pub state: ParamState<T>,
    /// Per tensor, the elements read so far.
    pub covered: BTreeMap<String, usize>,
}

impl<T: Element> Assembly<T> {
    pub fn new(name: String, range: Range<usize>) -> Self {
        Self {
            name,
            range,
            state: ParamState::default(),
            covered: BTreeMap::new(),
        }
    }

    /// The elements of the parameter both `saved` and this piece hold.
    pub fn overlap(&self, saved: &PieceRecord) -> Option<Range<usize>> {
        let lo = saved.offset.max(self.range.start);
        let hi = (saved.offset + saved.len).min(self.range.end);
        (saved.name == self.name && lo < hi).then_some(lo..hi)
    }

    /// Takes what overlaps this piece of the saved piece's scalar or tensor
    /// `state` (named `tensor_name` in the file at `path`), converted from
    /// the precision it was saved in.
    pub fn take(
        &mut self,
        path: &Path,
        saved: &PieceRecord,
        (tensor_name, state): (&str, &str),
        t: &TensorBytes<'_>,
    ) -> Result<()> {
        let Some(common) = self.overlap(saved) else {
            return Ok(());
        };
        if t.shape.is_empty() {
            let v = t
                .to_vec::<f64>()
                .map_err(|e| checkpoint_error(path, format!("scalar {tensor_name:?}: {e}")))?;
            let value = v.first().copied().ok_or_else(|| {
                checkpoint_error(path, format!("scalar {tensor_name:?} is empty"))
            })?;
            self.state.scalars.insert(state.to_string(), value);
            return Ok(());
        }
        if t.shape != [saved.len] {
            return Err(checkpoint_error(
                path,
                format!(
                    "tensor {tensor_name:?} is {} {:?}, the manifest says {} [{}]",
                    t.dtype,
                    t.shape,
                    T::DTYPE,
                    saved.len
                ),
            ));
        }
        let from = common.start - saved.offset;
        let len = self.range.len();
        let dst = self
            .state
            .tensors
            .entry(state.to_string())
            .or_insert_with(|| vec![T::default(); len]);
        let at = common.start - self.range.start;
        t.read_range_as(from..from + common.len(), &mut dst[at..at + common.len()])
            .map_err(|e| checkpoint_error(path, format!("{tensor_name:?}: {e}")))?;
        *self.covered.entry(state.to_string()).or_default() += common.len();
        Ok(())
    }

    /// The assembled state under its key (`None` when nothing was saved
    /// for it); an error naming the manifest if a tensor is not whole.
    #[allow(clippy::type_complexity)]
    pub fn finish(self, manifest_path: &Path) -> Result<Option<((String, usize), ParamState<T>)>> {
        for (tensor, &got) in &self.covered {
            if got != self.range.len() {
                return Err(checkpoint_error(
                    manifest_path,
                    format!(
                        "the rank files cover {got} of the {} elements of state {tensor:?} of \
                         {:?} {:?}; the checkpoint is incomplete",
                        self.range.len(),
                        self.name,
                        self.range
                    ),
                ));
            }
        }
        let empty = self.state.tensors.is_empty() && self.state.scalars.is_empty();
        Ok((!empty).then_some(((self.name, self.range.start), self.state)))
    }
}

/// What each exported piece is, for the receiver: its length (from the
/// owned pieces, else its first tensor's), scalars and tensor names, and a
/// tensor of another length flagged.
pub(in crate::engine) fn piece_metas<T>(
    exported: &BTreeMap<(String, usize), ParamState<T>>,
    lengths: &BTreeMap<(&str, usize), usize>,
) -> Vec<PieceMeta> {
    exported
        .iter()
        .map(|((name, offset), state)| {
            let len = lengths
                .get(&(name.as_str(), *offset))
                .copied()
                .or_else(|| state.tensors.values().next().map(Vec::len))
                .unwrap_or(0);
            PieceMeta {
                name: name.clone(),
                offset: *offset,
                len,
                scalars: state
                    .scalars
                    .iter()
                    .map(|(n, v)| (n.clone(), v.to_bits()))
                    .collect(),
                tensors: state.tensors.keys().cloned().collect(),
                bad_len: state.tensors.values().map(Vec::len).find(|&l| l != len),
            }
        })
        .collect()
}

/// Hands the pieces `metas`, received end to end in `recv`, to `sink`.
pub(in crate::engine) fn sink_pieces<T>(
    sink: &mut dyn PieceSink<T>,
    metas: &[PieceMeta],
    recv: &[T],
) -> Result<()> {
    let mut at = 0;
    for meta in metas {
        let n = meta.len * meta.tensors.len();
        sink.piece(meta, &recv[at..at + n])?;
        at += n;
    }
    Ok(())
}

/// The tensors of the pieces `metas` (taken out of `exported`) end to end,
/// `count` elements in all.
pub(in crate::engine) fn pack_pieces<T: Element>(
    exported: &mut BTreeMap<(String, usize), ParamState<T>>,
    metas: &[PieceMeta],
    count: usize,
) -> Vec<T> {
    let mut send = Vec::with_capacity(count);
    for meta in metas {
        let state = exported
            .remove(&(meta.name.clone(), meta.offset))
            .unwrap_or_default();
        for t in &meta.tensors {
            let start = send.len();
            if let Some(values) = state.tensors.get(t) {
                send.extend_from_slice(&values[..values.len().min(meta.len)]);
            }
            // Keep the agreed count even for a malformed tensor (flagged in
            // `bad_len`), so no rank waits forever.
            send.resize(start + meta.len, T::default());
        }
    }
    send
}
