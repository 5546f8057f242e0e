//! File primitives for checkpoints: atomic writes, verified reads,
//! safetensors files (written one tensor at a time, read through a memory
//! map) and the manifest.

use super::state_dict::GroupState;
use crate::partition::{ParamInfo, PartitionKind};
use crate::{DType, Element, Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The checkpoint format this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// What was written to a file: its SHA-256 and length, as recorded in the
/// [`Manifest`] and checked by [`read_verified`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileRecord {
    /// SHA-256 of the contents, lowercase hex.
    pub sha256: String,
    /// Length in bytes.
    pub len: u64,
}

pub(crate) fn io_error(path: &Path, source: io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn checkpoint_error(path: &Path, detail: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

pub(crate) fn hex(digest: &[u8]) -> String {
    use std::fmt::Write as _;
    digest.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Hashes and counts what passes through it.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    len: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Distinguishes temporary files of concurrent writes in one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh temporary file name next to `file_name` in `dir`.
pub(crate) fn temp_path(dir: &Path, file_name: &std::ffi::OsStr) -> std::path::PathBuf {
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(file_name);
    temp_name.push(format!(
        ".tmp.{}.{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    dir.join(temp_name)
}

/// The directory `path` is in and a fresh [`temp_path`] beside it; an
/// error if `path` names no file.
pub(crate) fn temp_beside(path: &Path) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    let file_name = path
        .file_name()
        .ok_or_else(|| checkpoint_error(path, "not a file path (it has no file name)"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Ok((dir.to_path_buf(), temp_path(dir, file_name)))
}

/// Whether `name` is one of [`temp_path`]'s names,
/// `.<file name>.tmp.<pid>.<n>`.
fn is_temp_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.') else {
        return false;
    };
    let number =
        |s: Option<&str>| s.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    let mut parts = rest.rsplitn(4, '.');
    number(parts.next())
        && number(parts.next())
        && parts.next() == Some("tmp")
        && parts.next().is_some_and(|s| !s.is_empty())
}

/// Removes the temporary files of interrupted writes from `dir`. A process
/// killed mid-write (`kill -9`, a crash, a lost node) cannot remove its own,
/// and nothing else ever would. Best effort: a file left behind wastes
/// space, nothing more.
fn remove_interrupted_writes(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_str().is_some_and(is_temp_name) {
            if let Err(e) = fs::remove_file(entry.path()) {
                tracing::debug!(
                    "cannot remove {}, left by an interrupted write: {e}",
                    entry.path().display()
                );
            }
        }
    }
}

/// Writes a file atomically: readers see the previous file or the complete
/// new one, never a partial write.
///
/// `write` fills a temporary file in the same directory (named
/// `.<file name>.tmp.<pid>.<n>`); the file is then fsynced, renamed over
/// `path`, and the directory fsynced so the rename survives a crash. If
/// `write` or any step up to the rename fails, the temporary file is removed
/// and whatever was at `path` is untouched. (If only the final directory
/// fsync fails, the new file is in place but may not survive a power loss;
/// the error says so by naming the directory.) Returns the SHA-256 and
/// length of what was written, computed on the way through.
///
/// `write` returns an [`io::Result`]; wrap other failures with
/// [`io::Error::other`]. A [`crate::Error`] wrapped that way comes back
/// unchanged, anything else as [`Error::Io`] naming `path`.
///
/// ```
/// # fn main() -> zero_core::Result<()> {
/// # let dir = std::env::temp_dir().join(format!("zero-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// use std::io::Write;
/// let record = zero_core::checkpoint::write_atomic(dir.join("hello.txt"), |w| {
///     w.write_all(b"hello")
/// })?;
/// assert_eq!(record.len, 5);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok(()) }
/// ```
pub fn write_atomic<F>(path: impl AsRef<Path>, write: F) -> Result<FileRecord>
where
    F: FnOnce(&mut dyn Write) -> io::Result<()>,
{
    let path = path.as_ref();
    let mut file = AtomicFile::create(path)?;
    write(&mut file.writer).map_err(|e| from_write_error(path, e))?;
    file.commit()
}

/// Removes a temporary file when dropped, unless [`kept`](TempGuard::keep):
/// whatever path a write leaves early by, no temporary file stays behind.
struct TempGuard(PathBuf);

impl TempGuard {
    /// The file was renamed into place: nothing to remove.
    fn keep(mut self) {
        self.0 = PathBuf::new();
    }
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            // Best effort: the error that matters is the one being returned.
            let _ = fs::remove_file(&self.0);
        }
    }
}

/// A file being written atomically, the mechanism of [`write_atomic`] and
/// [`TensorWriter`]: a temporary file beside `path`, hashed on the way
/// through, renamed over `path` by [`commit`](AtomicFile::commit). Dropped
/// uncommitted, it removes the temporary file and `path` is untouched.
struct AtomicFile {
    path: PathBuf,
    dir: PathBuf,
    temp: TempGuard,
    writer: HashingWriter<BufWriter<File>>,
}

impl AtomicFile {
    fn create(path: &Path) -> Result<Self> {
        let (dir, temp) = temp_beside(path)?;
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| io_error(&temp, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            dir,
            temp: TempGuard(temp),
            writer: HashingWriter {
                inner: BufWriter::new(file),
                hasher: Sha256::new(),
                len: 0,
            },
        })
    }

    /// Flushes and fsyncs the file, renames it over `path` and fsyncs the
    /// directory; returns the checksum and length of what was written.
    fn commit(self) -> Result<FileRecord> {
        let Self {
            path,
            dir,
            temp,
            writer: HashingWriter { inner, hasher, len },
        } = self;
        let file = inner
            .into_inner()
            .map_err(|e| io_error(&temp.0, e.into_error()))?;
        file.sync_all().map_err(|e| io_error(&temp.0, e))?;
        drop(file);
        fs::rename(&temp.0, &path).map_err(|e| io_error(&path, e))?;
        temp.keep();
        sync_dir(&dir)?;
        Ok(FileRecord {
            sha256: hex(&hasher.finalize()),
            len,
        })
    }
}

/// Unwraps a [`crate::Error`] that a writer callback smuggled through
/// [`io::Error::other`]; names `path` on anything else.
fn from_write_error(path: &Path, e: io::Error) -> Error {
    if e.get_ref().is_some_and(|inner| inner.is::<Error>()) {
        let kind = e.kind();
        if let Some(inner) = e.into_inner() {
            return match inner.downcast::<Error>() {
                Ok(error) => *error,
                Err(inner) => io_error(path, io::Error::new(kind, inner)),
            };
        }
        return io_error(path, io::Error::from(kind));
    }
    io_error(path, e)
}

/// Makes a rename in `dir` durable. Directories cannot be opened for syncing
/// on every platform; where they cannot, the rename is as durable as the
/// file system makes it.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_error(dir, e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// A writer that fails after a set number of bytes: fault injection for
/// tests of code that writes files.
///
/// It passes the first `limit` bytes through to the inner writer, then every
/// write fails with [`io::ErrorKind::Other`]. Wrap the writer that
/// [`write_atomic`] hands out to prove that a failed save leaves the previous
/// file intact:
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("zero-doc-fail-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// use std::io::Write;
/// use zero_core::checkpoint::{write_atomic, FailAfter};
/// let path = dir.join("data.bin");
/// write_atomic(&path, |w| w.write_all(b"old")).unwrap();
/// let err = write_atomic(&path, |w| FailAfter::new(w, 2).write_all(b"new contents"));
/// assert!(err.is_err());
/// assert_eq!(std::fs::read(&path).unwrap(), b"old");
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[derive(Debug)]
pub struct FailAfter<W> {
    inner: W,
    remaining: usize,
}

impl<W: Write> FailAfter<W> {
    /// Wraps `inner`, failing once `limit` bytes have been written.
    pub fn new(inner: W, limit: usize) -> Self {
        Self {
            inner,
            remaining: limit,
        }
    }
}

impl<W: Write> Write for FailAfter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.remaining == 0 && !buf.is_empty() {
            return Err(io::Error::other("injected write failure (FailAfter)"));
        }
        let n = buf.len().min(self.remaining);
        let written = self.inner.write(&buf[..n])?;
        self.remaining -= written;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Opens a file a manifest records, naming a missing one as such.
fn open_recorded(path: &Path) -> Result<File> {
    match File::open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(checkpoint_error(
            path,
            "file is missing; was the checkpoint copied completely?",
        )),
        Err(e) => Err(io_error(path, e)),
    }
}

fn check_len(path: &Path, found: u64, expected: u64) -> Result<()> {
    if found == expected {
        return Ok(());
    }
    let what = if found < expected {
        "the file is truncated"
    } else {
        "the file has extra bytes"
    };
    Err(checkpoint_error(
        path,
        format!("expected {expected} bytes, found {found}; {what}"),
    ))
}

fn check_sha256(path: &Path, hasher: Sha256, expected: &str) -> Result<()> {
    let found = hex(&hasher.finalize());
    if found.eq_ignore_ascii_case(expected) {
        return Ok(());
    }
    Err(checkpoint_error(
        path,
        format!(
            "checksum mismatch: expected {expected}, found {found}; \
             the file is corrupted or was replaced"
        ),
    ))
}

/// Reads a whole file and checks its length and SHA-256 against what was
/// recorded when it was written.
///
/// Fails with [`Error::Checkpoint`] naming the file if it is missing, has
/// another length (truncated or grown), or its checksum differs. To check a
/// large file without holding it, use [`verify_file`] or
/// [`Manifest::map_file`].
pub fn read_verified(
    path: impl AsRef<Path>,
    expected_sha256: &str,
    expected_len: u64,
) -> Result<Vec<u8>> {
    let path = path.as_ref();
    let mut file = open_recorded(path)?;
    let on_disk = file.metadata().map_err(|e| io_error(path, e))?.len();
    check_len(path, on_disk, expected_len)?;

    let capacity = usize::try_from(expected_len).map_err(|_| {
        checkpoint_error(
            path,
            format!("{expected_len} bytes do not fit in memory on this platform"),
        )
    })?;
    let mut bytes = Vec::with_capacity(capacity);
    file.read_to_end(&mut bytes)
        .map_err(|e| io_error(path, e))?;
    check_len(path, bytes.len() as u64, expected_len)?;
    check_sha256(path, Sha256::new_with_prefix(&bytes), expected_sha256)?;
    Ok(bytes)
}

/// Checks a file's length and SHA-256 against what was recorded when it was
/// written, as [`read_verified`] does, reading it in chunks of 1 MiB: it
/// never holds the file.
pub fn verify_file(path: impl AsRef<Path>, expected_sha256: &str, expected_len: u64) -> Result<()> {
    let path = path.as_ref();
    let mut file = open_recorded(path)?;
    let on_disk = file.metadata().map_err(|e| io_error(path, e))?.len();
    check_len(path, on_disk, expected_len)?;
    let mut hasher = Sha256::new();
    let mut chunk = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(path, e)),
        };
        hasher.update(&chunk[..n]);
        len += n as u64;
    }
    check_len(path, len, expected_len)?;
    check_sha256(path, hasher, expected_sha256)
}

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
        crate::engine::convert_slice(src, out);
        return;
    }
    const CHUNK: usize = 4096;
    let mut aligned = [S::default(); CHUNK];
    let size = std::mem::size_of::<S>();
    for (src, dst) in bytes.chunks(CHUNK * size).zip(out.chunks_mut(CHUNK)) {
        let buf = &mut aligned[..dst.len()];
        bytemuck::cast_slice_mut::<S, u8>(buf).copy_from_slice(src);
        crate::engine::convert_slice(buf, dst);
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
    fn map(path: &Path, record: Option<&FileRecord>) -> Result<Self> {
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

/// The index of a checkpoint directory, stored as [`MANIFEST_FILE`].
///
/// The manifest is the commit point of a save: write every data file first
/// (recording each [`FileRecord`] in [`files`](Manifest::files)), then the
/// manifest, atomically. A directory whose manifest loads is complete.
///
/// To extend it, add public fields with `#[serde(default)]` so older
/// manifests still load, and raise [`FORMAT_VERSION`] only for changes an
/// older build must refuse. Fields this build does not know are kept in
/// [`extra`](Manifest::extra) and written back unchanged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The format version; [`Manifest::load`] refuses versions newer than
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Every data file of the checkpoint, by path relative to the
    /// directory, with its checksum and length.
    #[serde(default)]
    pub files: BTreeMap<String, FileRecord>,
    /// What the checkpoint holds and how it was saved (written by the
    /// engine's saves; `None` for a bare manifest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointInfo>,
    /// Fields this build does not know, kept as they were.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Default for Manifest {
    fn default() -> Self {
        Self::new()
    }
}

/// Just the version, read before the rest so that a newer format fails on
/// its version rather than on a field this build does not understand.
#[derive(Deserialize)]
struct VersionOnly {
    format_version: u32,
}

impl Manifest {
    /// An empty manifest at [`FORMAT_VERSION`].
    pub fn new() -> Self {
        Self {
            format_version: FORMAT_VERSION,
            files: BTreeMap::new(),
            checkpoint: None,
            extra: BTreeMap::new(),
        }
    }

    /// Loads `dir/manifest.json`, refusing unknown format versions.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join(MANIFEST_FILE);
        let bytes =
            match fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(checkpoint_error(
                    &path,
                    "no manifest; is this a zero-rs checkpoint directory, and did the save finish?",
                )),
                Err(e) => return Err(io_error(&path, e)),
            };
        let version: VersionOnly = serde_json::from_slice(&bytes).map_err(|e| {
            checkpoint_error(
                &path,
                format!("not a valid manifest (no format_version?): {e}"),
            )
        })?;
        match version.format_version {
            0 => {
                return Err(checkpoint_error(
                    &path,
                    "format version 0 is not a valid version; the manifest is corrupted",
                ))
            }
            v if v > FORMAT_VERSION => {
                return Err(checkpoint_error(
                    &path,
                    format!(
                        "format version {v} is newer than this build supports ({FORMAT_VERSION}); upgrade zero-rs"
                    ),
                ))
            }
            _ => {}
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| checkpoint_error(&path, format!("not a valid manifest: {e}")))
    }

    /// Writes `dir/manifest.json` atomically. Call it last in a save, once
    /// every data file is in place and nothing else writes into `dir`.
    ///
    /// It first removes the temporary files (`.<name>.tmp.<pid>.<n>`) that
    /// processes killed in the middle of an earlier save left in `dir`.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<FileRecord> {
        let dir = dir.as_ref();
        // Every writer of this save has finished (the engine's ranks wait
        // for the commit), so any temporary file here belongs to a write
        // that will never finish. Removing them before the commit rather
        // than after means a process killed just after the commit has none
        // left to leak; one killed during the removal has not committed, and
        // the save that redoes its step removes the rest.
        remove_interrupted_writes(dir);
        let path = dir.join(MANIFEST_FILE);
        write_atomic(&path, |w| {
            serde_json::to_writer_pretty(&mut *w, self)?;
            w.write_all(b"\n")
        })
    }

    /// Records a data file written into the checkpoint.
    pub fn record(&mut self, name: impl Into<String>, record: FileRecord) {
        self.files.insert(name.into(), record);
    }

    /// Reads the data file `name` of the checkpoint in `dir`, verified
    /// against its record. For files too large to hold, use
    /// [`map_file`](Manifest::map_file).
    ///
    /// Fails if the manifest does not list `name`, if `name` is not a plain
    /// relative path inside the directory, or as [`read_verified`] does.
    pub fn read_file(&self, dir: impl AsRef<Path>, name: &str) -> Result<Vec<u8>> {
        let (path, record) = self.file_path(dir.as_ref(), name)?;
        read_verified(path, &record.sha256, record.len)
    }

    /// Maps the safetensors data file `name` of the checkpoint in `dir`
    /// (see [`MappedTensors`]) once its length and SHA-256 match its record,
    /// checked by streaming through the mapping: the file is never copied
    /// into memory.
    ///
    /// Fails as [`read_file`](Manifest::read_file) does, or if the file is
    /// not a safetensors file of supported dtypes.
    pub fn map_file(&self, dir: impl AsRef<Path>, name: &str) -> Result<MappedTensors> {
        let (path, record) = self.file_path(dir.as_ref(), name)?;
        MappedTensors::map(&path, Some(record))
    }

    /// Where the listed data file `name` is, and its record.
    fn file_path(&self, dir: &Path, name: &str) -> Result<(PathBuf, &FileRecord)> {
        let record = self.files.get(name).ok_or_else(|| {
            checkpoint_error(
                &dir.join(MANIFEST_FILE),
                format!("lists no file {name:?}; the checkpoint is incomplete or of another kind"),
            )
        })?;
        let relative = Path::new(name);
        if name.is_empty()
            || !relative
                .components()
                .all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(checkpoint_error(
                &dir.join(MANIFEST_FILE),
                format!("file name {name:?} is not a plain relative path inside the checkpoint"),
            ));
        }
        Ok((dir.join(relative), record))
    }
}

/// Whether a checkpoint holds per-rank optimizer shards or one consolidated
/// optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointKind {
    /// One optimizer file per saving rank, plus the model weights
    /// (`Engine::save_checkpoint`).
    Sharded,
    /// One unsharded optimizer file (`Engine::save_consolidated`).
    Consolidated,
}

/// A piece of a parameter whose optimizer state a per-rank file holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PieceRecord {
    /// The parameter's name.
    pub name: String,
    /// Offset of the piece within the flattened parameter.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

/// One rank's optimizer file in a sharded checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardRecord {
    /// The rank (of the partition plan) that wrote it.
    pub rank: usize,
    /// The file, relative to the checkpoint directory.
    pub file: String,
    /// The pieces whose state it holds, as tensors named
    /// `state.<name>.<offset>.<state name>` (scalars such as `step` as f64
    /// tensors of shape `[]`). Pieces never stepped have no tensors.
    pub pieces: Vec<PieceRecord>,
}

/// The typed description of a checkpoint in its [`Manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// Sharded or consolidated.
    pub kind: CheckpointKind,
    /// Distinguishes the files of this save from those of earlier saves
    /// into the same directory (e.g. `step12`).
    #[serde(default)]
    pub tag: String,
    /// The communicator's world size at save.
    pub world_size: usize,
    /// The ZeRO stage at save (0, 1 or 2).
    pub stage: u8,
    /// The partitioner at save.
    pub partition: PartitionKind,
    /// The model's parameters: names, shapes, dtypes, trainability.
    pub params: Vec<ParamInfo>,
    /// The optimizer's kind, e.g. `"adam"`.
    pub optimizer: String,
    /// Hyperparameters and members of each parameter group.
    pub param_groups: Vec<GroupState>,
    /// Optimizer steps taken at save.
    pub steps: u64,
    /// The loss scaler's state at save (runs with loss scaling).
    #[serde(default)]
    pub loss_scaler: Option<crate::engine::LossScalerState>,
    /// The model weights under parameter names (sharded checkpoints).
    #[serde(default)]
    pub model_file: Option<String>,
    /// Per saving rank, its optimizer file and pieces (sharded
    /// checkpoints).
    #[serde(default)]
    pub shards: Vec<ShardRecord>,
    /// What the user stored with the checkpoint (e.g. data position and
    /// learning rate); `null` when nothing.
    #[serde(default)]
    pub user: serde_json::Value,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names_are_recognized_and_nothing_else() {
        let temp = temp_path(
            Path::new("d"),
            std::ffi::OsStr::new("model.step3.safetensors"),
        );
        let name = temp.file_name().and_then(|n| n.to_str()).unwrap();
        assert!(is_temp_name(name), "{name}");
        assert!(is_temp_name(".manifest.json.tmp.41.0"));
        for other in [
            "manifest.json",
            "model.step3.safetensors",
            ".hidden",
            ".tmp.1.2",
            ".x.tmp.1.",
            ".x.tmp.a.2",
            ".x.tmq.1.2",
            "x.tmp.1.2",
        ] {
            assert!(!is_temp_name(other), "{other}");
        }
    }

    #[test]
    fn manifest_save_removes_what_killed_writes_left() {
        let dir = tempfile::tempdir().unwrap();
        let leftovers = [
            ".model.step4.safetensors.tmp.999999.7",
            ".manifest.json.tmp.999999.8",
        ];
        for name in leftovers {
            fs::write(dir.path().join(name), b"partial").unwrap();
        }
        fs::write(dir.path().join(".keep"), b"not ours").unwrap();
        let record = write_atomic(dir.path().join("model.step5.safetensors"), |w| {
            w.write_all(b"weights")
        })
        .unwrap();
        let mut manifest = Manifest::new();
        manifest.record("model.step5.safetensors", record);
        manifest.save(dir.path()).unwrap();
        let mut names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".keep", MANIFEST_FILE, "model.step5.safetensors"]);
    }
}
