//! Safetensors files: written one tensor at a time, read whole or through
//! a memory map.

use super::files::*;
use crate::{DType, Element, Error, Result};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One tensor as raw little-endian bytes: what [`save_tensors`] writes and
/// [`load_tensors`] and [`MappedTensors::get`] return.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorBytes<'a> {
    /// Element type.
    pub dtype: DType,
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// `shape.iter().product() * dtype.size_in_bytes()` bytes, row-major.
    pub data: &'a [u8],
}

impl TensorBytes<'_> {
    /// Copies the elements out as `T`, which must be the tensor's dtype. The
    /// bytes need not be aligned for `T`.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::Config(format!(
                "tensor holds {}, not {}",
                self.dtype,
                T::DTYPE
            )));
        }
        let mut out = vec![T::default(); self.numel()?];
        // Copy through a correctly aligned buffer: file data may be unaligned.
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(self.data);
        Ok(out)
    }

    /// Copies the elements out converted to `T` from any float dtype
    /// (exact when widening, rounded to nearest when narrowing): a
    /// checkpoint of one precision loads into an engine of another.
    pub fn to_vec_as<T: Element>(&self) -> Result<Vec<T>> {
        let mut out = vec![T::default(); self.numel()?];
        self.read_range_as(0..out.len(), &mut out)?;
        Ok(out)
    }

    /// Writes elements `range` of the flattened tensor into `out`, converted
    /// to `T` as [`to_vec_as`](TensorBytes::to_vec_as) converts: a rank
    /// reads the part of a parameter it owns without copying the rest.
    ///
    /// Fails if `range` is not within the tensor or `out` is not
    /// `range.len()` long. The bytes need not be aligned for the dtype.
    pub fn read_range_as<T: Element>(&self, range: Range<usize>, out: &mut [T]) -> Result<()> {
        let numel = self.numel()?;
        if range.start > range.end || range.end > numel {
            return Err(Error::Config(format!(
                "elements {range:?} are outside the tensor's {numel} elements"
            )));
        }
        if out.len() != range.len() {
            return Err(Error::BufferSize {
                op: "read_range_as",
                what: "out",
                got: out.len(),
                expected: range.len(),
            });
        }
        let size = self.dtype.size_in_bytes();
        let bytes = &self.data[range.start * size..range.end * size];
        match self.dtype {
            DType::F32 => convert_bytes::<f32, T>(bytes, out),
            DType::F64 => convert_bytes::<f64, T>(bytes, out),
            DType::BF16 => convert_bytes::<half::bf16, T>(bytes, out),
            DType::F16 => convert_bytes::<half::f16, T>(bytes, out),
        }
        Ok(())
    }

    /// The number of elements, from the data's length.
    fn numel(&self) -> Result<usize> {
        let size = self.dtype.size_in_bytes();
        if self.data.len() % size != 0 {
            return Err(Error::Config(format!(
                "tensor data of {} bytes is not a whole number of {} elements",
                self.data.len(),
                self.dtype
            )));
        }
        Ok(self.data.len() / size)
    }
}

/// Converts `bytes`, elements of `S`, into `out`. File data may be
/// unaligned for `S`: then it goes through an aligned buffer, a chunk at a
/// time.
fn convert_bytes<S: Element, T: Element>(bytes: &[u8], out: &mut [T]) {
    if S::DTYPE == T::DTYPE {
        bytemuck::cast_slice_mut::<T, u8>(out).copy_from_slice(bytes);
        return;
    }
    if let Ok(src) = bytemuck::try_cast_slice::<u8, S>(bytes) {
        crate::dtype::convert_slice(src, out);
        return;
    }
    const CHUNK: usize = 4096;
    let mut aligned = [S::default(); CHUNK];
    let size = std::mem::size_of::<S>();
    for (src, dst) in bytes.chunks(CHUNK * size).zip(out.chunks_mut(CHUNK)) {
        let buf = &mut aligned[..dst.len()];
        bytemuck::cast_slice_mut::<S, u8>(buf).copy_from_slice(src);
        crate::dtype::convert_slice(buf, dst);
    }
}

pub(crate) fn to_safetensors(dtype: DType) -> safetensors::Dtype {
    match dtype {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
    }
}

pub(crate) fn from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
    match dtype {
        safetensors::Dtype::F32 => Some(DType::F32),
        safetensors::Dtype::F64 => Some(DType::F64),
        safetensors::Dtype::BF16 => Some(DType::BF16),
        safetensors::Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

/// The order [`write_tensors`] stores tensors in, as the `safetensors`
/// crate does: by element size, largest first, then by name. Every tensor
/// then starts aligned to its element size in the file.
pub(crate) fn file_order(left: (&str, DType), right: (&str, DType)) -> std::cmp::Ordering {
    right
        .1
        .size_in_bytes()
        .cmp(&left.1.size_in_bytes())
        .then_with(|| left.0.cmp(right.0))
}

/// The start of a safetensors file holding `tensors` (name, dtype, shape)
/// in this order: the header's length (8 bytes, little-endian) and the JSON
/// header, padded with spaces to a multiple of 8 bytes as the format asks.
/// Returns it with each tensor's data length in bytes. `path` only names the
/// file in errors.
fn safetensors_header<'a>(
    path: &Path,
    tensors: impl ExactSizeIterator<Item = (&'a str, DType, &'a [usize])>,
) -> Result<(Vec<u8>, Vec<usize>)> {
    use safetensors::tensor::{Metadata, TensorInfo};

    let mut infos = Vec::with_capacity(tensors.len());
    let mut lengths = Vec::with_capacity(tensors.len());
    let mut seen = std::collections::BTreeSet::new();
    let mut offset = 0usize;
    for (name, dtype, shape) in tensors {
        if !seen.insert(name) {
            return Err(checkpoint_error(
                path,
                format!("tensor {name:?} is given twice"),
            ));
        }
        let len = shape
            .iter()
            .try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d))
            .and_then(|len| offset.checked_add(len).map(|end| (len, end)));
        let Some((len, end)) = len else {
            return Err(checkpoint_error(
                path,
                format!(
                    "tensor {name:?} of shape {shape:?} and dtype {dtype} ends past {} bytes",
                    usize::MAX
                ),
            ));
        };
        infos.push((
            name.to_string(),
            TensorInfo {
                dtype: to_safetensors(dtype),
                shape: shape.to_vec(),
                data_offsets: (offset, end),
            },
        ));
        lengths.push(len);
        offset = end;
    }
    let metadata = Metadata::new(None, infos)?;
    let json = serde_json::to_vec(&metadata)?;
    let padded = json.len().next_multiple_of(8);
    let mut header = Vec::with_capacity(8 + padded);
    header.extend_from_slice(&(padded as u64).to_le_bytes());
    header.extend_from_slice(&json);
    header.resize(8 + padded, b' ');
    Ok((header, lengths))
}

/// Streams `tensors` in the safetensors format to `w`, without building the
/// file in memory. `path` only names the file in errors.
///
/// Tensors are stored sorted by element size (largest first) and then by
/// name, as the `safetensors` crate does, so every tensor stays aligned to
/// its element size in the file.
pub fn write_tensors<N: AsRef<str>>(
    path: &Path,
    w: &mut dyn Write,
    tensors: &[(N, TensorBytes<'_>)],
) -> Result<()> {
    let mut order: Vec<&(N, TensorBytes<'_>)> = tensors.iter().collect();
    order
        .sort_by(|(ln, lt), (rn, rt)| file_order((ln.as_ref(), lt.dtype), (rn.as_ref(), rt.dtype)));

    let (header, lengths) = safetensors_header(
        path,
        order
            .iter()
            .map(|(name, t)| (name.as_ref(), t.dtype, t.shape.as_slice())),
    )?;
    for ((name, t), &expected) in order.iter().zip(&lengths) {
        if t.data.len() != expected {
            return Err(checkpoint_error(
                path,
                format!(
                    "tensor {:?} of shape {:?} and dtype {} has {} bytes of data, expected {expected}",
                    name.as_ref(),
                    t.shape,
                    t.dtype,
                    t.data.len(),
                ),
            ));
        }
    }
    let write_err = |e| from_write_error(path, e);
    w.write_all(&header).map_err(write_err)?;
    for (_, t) in order {
        w.write_all(t.data).map_err(write_err)?;
    }
    Ok(())
}

/// Saves `tensors` as a safetensors file at `path`, atomically (see
/// [`write_atomic`]), and returns its checksum and length.
pub fn save_tensors<N: AsRef<str>>(
    path: impl AsRef<Path>,
    tensors: &[(N, TensorBytes<'_>)],
) -> Result<FileRecord> {
    let path = path.as_ref();
    write_atomic(path, |w| {
        write_tensors(path, w, tensors).map_err(io::Error::other)
    })
}

/// Writes a safetensors file one tensor at a time, so that its writer never
/// holds more than the bytes it is passing on: the header is fixed by
/// [`create`](TensorWriter::create) from the tensors' names, dtypes and
/// shapes, and the data follows in that order through
/// [`write`](TensorWriter::write).
///
/// The file is written as [`write_atomic`] writes: into a temporary file
/// beside `path`, renamed over `path` by [`finish`](TensorWriter::finish)
/// only once every announced byte came. Dropped without `finish` (an error,
/// a panic), it removes the temporary file: nothing half-written is ever at
/// `path`, and a file already there stays as it was.
///
/// Tensors are stored in the order given. Given in [`write_tensors`]'
/// order (element size, largest first, then name), the file is byte for
/// byte the one [`write_tensors`] writes, and every tensor is aligned to its
/// element size; another order gives a valid file whose tensors may be
/// unaligned.
///
/// ```
/// # fn main() -> zero_core::Result<()> {
/// # let dir = std::env::temp_dir().join(format!("zero-doc-tw-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// use zero_core::checkpoint::{MappedTensors, TensorWriter};
/// use zero_core::DType;
/// let path = dir.join("weights.safetensors");
/// let mut writer = TensorWriter::create(&path, &[("w".to_string(), DType::F32, vec![3])])?;
/// writer.write(bytemuck::cast_slice(&[1.0f32, 2.0]))?; // a tensor may come in parts
/// writer.write(bytemuck::bytes_of(&3.0f32))?;
/// let record = writer.finish()?;
///
/// let file = MappedTensors::open(&path)?;
/// let w = file.get("w").expect("written above");
/// assert_eq!(w.to_vec::<f32>()?, [1.0, 2.0, 3.0]);
/// assert_eq!(record.len, std::fs::metadata(&path).unwrap().len());
/// # drop(file);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok(()) }
/// ```
pub struct TensorWriter {
    file: AtomicFile,
    /// Each tensor's name and byte range in the data, in file order.
    tensors: Vec<(String, Range<usize>)>,
    /// Data bytes written so far.
    written: usize,
    /// Set by a failed [`write`](TensorWriter::write): the data is no longer
    /// what the caller meant, so the file must not be finished.
    failed: bool,
}

impl std::fmt::Debug for TensorWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorWriter")
            .field("path", &self.file.path)
            .field("tensors", &self.tensors.len())
            .field("written", &self.written)
            .field("total", &self.total())
            .field("failed", &self.failed)
            .finish()
    }
}

impl TensorWriter {
    /// Starts a safetensors file at `path` holding `tensors` (name, dtype,
    /// shape) in this order: creates the temporary file beside `path` and
    /// writes the header.
    ///
    /// Fails on a name given twice, a shape whose size overflows, or if the
    /// temporary file cannot be created (the directory must exist).
    pub fn create(path: impl AsRef<Path>, tensors: &[(String, DType, Vec<usize>)]) -> Result<Self> {
        let path = path.as_ref();
        let (header, lengths) = safetensors_header(
            path,
            tensors
                .iter()
                .map(|(name, dtype, shape)| (name.as_str(), *dtype, shape.as_slice())),
        )?;
        let mut file = AtomicFile::create(path)?;
        file.writer
            .write_all(&header)
            .map_err(|e| io_error(path, e))?;
        let mut start = 0;
        let tensors = tensors
            .iter()
            .zip(lengths)
            .map(|((name, _, _), len)| {
                start += len;
                (name.clone(), start - len..start)
            })
            .collect();
        Ok(Self {
            file,
            tensors,
            written: 0,
            failed: false,
        })
    }

    /// Writes the next `bytes` of tensor data: little-endian, row-major, in
    /// each tensor's dtype, the tensors in the order given to
    /// [`create`](TensorWriter::create). A tensor may come in several calls,
    /// and one call may span tensors.
    ///
    /// Fails if more bytes come than the header announced, or on an I/O
    /// error; the writer can then only be dropped (its
    /// [`finish`](TensorWriter::finish) fails).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.check_not_failed()?;
        let total = self.total();
        let left = total - self.written;
        if bytes.len() > left {
            self.failed = true;
            let last = self.tensors.last().map_or_else(
                || "the header announces no tensor".to_string(),
                |(name, _)| format!("the last tensor is {name:?}"),
            );
            return Err(checkpoint_error(
                &self.file.path,
                format!(
                    "got {} bytes of tensor data with {left} of the {total} announced left \
                     ({last}); write each tensor's bytes exactly, in the order given to create",
                    bytes.len()
                ),
            ));
        }
        if let Err(e) = self.file.writer.write_all(bytes) {
            self.failed = true;
            return Err(io_error(&self.file.path, e));
        }
        self.written += bytes.len();
        Ok(())
    }

    /// Checks that every announced byte came, then flushes and fsyncs the
    /// file, renames it over `path` and fsyncs the directory. Returns its
    /// checksum and length, as [`write_atomic`] does.
    ///
    /// Fails (leaving `path` untouched and removing the temporary file) if
    /// bytes are missing or an earlier [`write`](TensorWriter::write) failed.
    pub fn finish(self) -> Result<FileRecord> {
        self.check_not_failed()?;
        if self.written < self.total() {
            let (name, range) = self
                .tensors
                .iter()
                .find(|(_, range)| range.end > self.written)
                .map_or(("", &(0..0)), |(name, range)| (name.as_str(), range));
            return Err(checkpoint_error(
                &self.file.path,
                format!(
                    "tensor {name:?} got {} of its {} bytes ({} bytes missing in all); \
                     write every tensor announced to create before finish",
                    self.written - range.start,
                    range.len(),
                    self.total() - self.written
                ),
            ));
        }
        self.file.commit()
    }

    /// Data bytes the header announced.
    fn total(&self) -> usize {
        self.tensors.last().map_or(0, |(_, range)| range.end)
    }

    fn check_not_failed(&self) -> Result<()> {
        if self.failed {
            return Err(checkpoint_error(
                &self.file.path,
                "an earlier write to this file failed; drop the TensorWriter and write the \
                 file again",
            ));
        }
        Ok(())
    }
}

/// Parses the bytes of a safetensors file (as returned by [`read_verified`])
/// into tensors by name, borrowing their data. `path` only names the file in
/// errors. [`MappedTensors`] reads a file without loading it.
///
/// Tensors of a dtype other than f32, f64, bf16 and f16 are an error naming
/// the tensor.
pub fn load_tensors<'a>(
    path: impl AsRef<Path>,
    bytes: &'a [u8],
) -> Result<BTreeMap<String, TensorBytes<'a>>> {
    let path = path.as_ref();
    let file = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| checkpoint_error(path, format!("not a valid safetensors file: {e}")))?;
    let mut tensors = BTreeMap::new();
    for (name, view) in file.iter() {
        tensors.insert(
            name.to_string(),
            TensorBytes {
                dtype: supported_dtype(path, name, view.dtype())?,
                shape: view.shape().to_vec(),
                data: view.data(),
            },
        );
    }
    Ok(tensors)
}

fn supported_dtype(path: &Path, name: &str, dtype: safetensors::Dtype) -> Result<DType> {
    from_safetensors(dtype).ok_or_else(|| {
        checkpoint_error(
            path,
            format!("tensor {name:?} has dtype {dtype:?}; zero-rs reads F32, F64, BF16 and F16"),
        )
    })
}

/// A safetensors file mapped into memory and parsed once: tensors are read
/// one at a time, or a range of one, straight from the mapping, without
/// reading the file into memory. A rank of a stage-3 run loads its part of
/// each parameter this way and never holds the whole model.
///
/// # The mapping
///
/// The file's pages are the operating system's page cache: reading a tensor
/// faults in its pages, and the kernel may drop them again under memory
/// pressure. Memory-mapping is `unsafe` in Rust because another process
/// could change the file while it is mapped, and the mapped bytes would
/// change under the references this type hands out (or, for a truncated
/// file, reading them would raise `SIGBUS`). zero-rs never changes a file in
/// place: its writes ([`write_atomic`], [`TensorWriter`]) rename a new file
/// over the old one, and a mapping keeps the old file's contents. Do not
/// let anything else write into or truncate a checkpoint file while it is
/// mapped (Candle's `MmapedSafetensors` asks the same).
#[derive(Debug)]
pub struct MappedTensors {
    path: PathBuf,
    mmap: memmap2::Mmap,
    /// Each tensor's dtype, shape and byte range in the mapping, by name.
    tensors: BTreeMap<String, (DType, Vec<usize>, Range<usize>)>,
}

impl MappedTensors {
    /// Maps and parses the safetensors file at `path`.
    ///
    /// Fails with [`Error::Checkpoint`] naming the file if it is missing,
    /// is not a valid safetensors file, or holds a tensor of a dtype other
    /// than f32, f64, bf16 and f16. See [the mapping](MappedTensors#the-mapping)
    /// for what must not happen to the file while it is open.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::map(path.as_ref(), None)
    }

    /// Maps `path`, checks the mapped bytes against `record` (length and
    /// SHA-256) when given, and parses them. Hashing the mapping, not a
    /// separate read, checks the very bytes that are parsed.
    pub(super) fn map(path: &Path, record: Option<&FileRecord>) -> Result<Self> {
        let file = open_recorded(path)?;
        // SAFETY: the mapping is read-only, and its contents are valid as
        // long as no one writes into or truncates the file while it is
        // mapped. zero-rs never does (it replaces files by renaming a new
        // one over them); the type's documentation asks the same of
        // everyone else.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_error(path, e))?;
        drop(file);
        if let Some(record) = record {
            check_len(path, mmap.len() as u64, record.len)?;
            let mut hasher = Sha256::new();
            // Page by page through the hasher: nothing is copied.
            for chunk in mmap.chunks(1 << 20) {
                hasher.update(chunk);
            }
            check_sha256(path, hasher, &record.sha256)?;
        }
        let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| checkpoint_error(path, format!("not a valid safetensors file: {e}")))?;
        // `read_metadata` checked that the tensors tile the data exactly, up
        // to the end of the file, so every range below is inside the mapping.
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        for name in metadata.offset_keys() {
            let Some(info) = metadata.info(&name) else {
                continue;
            };
            let dtype = supported_dtype(path, &name, info.dtype)?;
            let (start, end) = info.data_offsets;
            let range = data_start + start..data_start + end;
            tensors.insert(name, (dtype, info.shape.clone(), range));
        }
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            tensors,
        })
    }

    /// The tensor `name`, its data borrowed from the mapping; `None` if the
    /// file has no such tensor.
    pub fn get(&self, name: &str) -> Option<TensorBytes<'_>> {
        let (dtype, shape, range) = self.tensors.get(name)?;
        Some(TensorBytes {
            dtype: *dtype,
            shape: shape.clone(),
            data: self.mmap.get(range.clone())?,
        })
    }

    /// The names of the tensors, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The tensors whose names start with `prefix`, sorted by name.
    pub(crate) fn with_prefix<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a str, TensorBytes<'a>)> + 'a {
        self.tensors
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |(name, _)| name.starts_with(prefix))
            .filter_map(|(name, _)| Some((name.as_str(), self.get(name)?)))
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the file holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The file's path, for error messages.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
