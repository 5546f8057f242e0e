//! File primitives for checkpoints: atomic writes, verified reads,
//! safetensors files and the manifest.

use super::state_dict::GroupState;
use crate::partition::{ParamInfo, PartitionKind};
use crate::{DType, Element, Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Component, Path};
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
    let file_name = path
        .file_name()
        .ok_or_else(|| checkpoint_error(path, "not a file path (it has no file name)"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let temp = temp_path(dir, file_name);

    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .map_err(|e| io_error(&temp, e))?;

    let result = fill_and_sync(file, write, path, &temp).and_then(|record| {
        fs::rename(&temp, path).map_err(|e| io_error(path, e))?;
        Ok(record)
    });
    let record = match result {
        Ok(record) => record,
        Err(e) => {
            // Best effort: the error that matters is the one being returned.
            let _ = fs::remove_file(&temp);
            return Err(e);
        }
    };
    sync_dir(dir)?;
    Ok(record)
}

fn fill_and_sync<F>(file: File, write: F, path: &Path, temp: &Path) -> Result<FileRecord>
where
    F: FnOnce(&mut dyn Write) -> io::Result<()>,
{
    let mut writer = HashingWriter {
        inner: BufWriter::new(file),
        hasher: Sha256::new(),
        len: 0,
    };
    write(&mut writer).map_err(|e| from_write_error(path, e))?;
    let HashingWriter { inner, hasher, len } = writer;
    let file = inner
        .into_inner()
        .map_err(|e| io_error(temp, e.into_error()))?;
    file.sync_all().map_err(|e| io_error(temp, e))?;
    Ok(FileRecord {
        sha256: hex(&hasher.finalize()),
        len,
    })
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

/// Reads a whole file and checks its length and SHA-256 against what was
/// recorded when it was written.
///
/// Fails with [`Error::Checkpoint`] naming the file if it is missing, has
/// another length (truncated or grown), or its checksum differs.
pub fn read_verified(
    path: impl AsRef<Path>,
    expected_sha256: &str,
    expected_len: u64,
) -> Result<Vec<u8>> {
    let path = path.as_ref();
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(checkpoint_error(
                path,
                "file is missing; was the checkpoint copied completely?",
            ))
        }
        Err(e) => return Err(io_error(path, e)),
    };
    let check_len = |found: u64| -> Result<()> {
        if found == expected_len {
            return Ok(());
        }
        let what = if found < expected_len {
            "the file is truncated"
        } else {
            "the file has extra bytes"
        };
        Err(checkpoint_error(
            path,
            format!("expected {expected_len} bytes, found {found}; {what}"),
        ))
    };
    let on_disk = file.metadata().map_err(|e| io_error(path, e))?.len();
    check_len(on_disk)?;

    let capacity = usize::try_from(expected_len).map_err(|_| {
        checkpoint_error(
            path,
            format!("{expected_len} bytes do not fit in memory on this platform"),
        )
    })?;
    let mut bytes = Vec::with_capacity(capacity);
    file.read_to_end(&mut bytes)
        .map_err(|e| io_error(path, e))?;
    check_len(bytes.len() as u64)?;

    let found = hex(&Sha256::digest(&bytes));
    if !found.eq_ignore_ascii_case(expected_sha256) {
        return Err(checkpoint_error(
            path,
            format!(
                "checksum mismatch: expected {expected_sha256}, found {found}; \
                 the file is corrupted or was replaced"
            ),
        ));
    }
    Ok(bytes)
}

/// One tensor as raw little-endian bytes: what [`save_tensors`] writes and
/// [`load_tensors`] returns.
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
        let size = std::mem::size_of::<T>();
        if self.data.len() % size != 0 {
            return Err(Error::Config(format!(
                "tensor data of {} bytes is not a whole number of {} elements",
                self.data.len(),
                self.dtype
            )));
        }
        // Copy through a correctly aligned buffer: file data may be unaligned.
        let mut out = vec![T::default(); self.data.len() / size];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(self.data);
        Ok(out)
    }
}

impl TensorBytes<'_> {
    /// Copies the elements out converted to `T` from any float dtype
    /// (exact when widening, rounded to nearest when narrowing): a
    /// checkpoint of one precision loads into an engine of another.
    pub fn to_vec_as<T: Element>(&self) -> Result<Vec<T>> {
        fn convert<S: Element, T: Element>(t: &TensorBytes<'_>) -> Result<Vec<T>> {
            let src = t.to_vec::<S>()?;
            let mut out = vec![T::default(); src.len()];
            crate::engine::convert_slice(&src, &mut out);
            Ok(out)
        }
        match self.dtype {
            dtype if dtype == T::DTYPE => self.to_vec::<T>(),
            DType::F32 => convert::<f32, T>(self),
            DType::F64 => convert::<f64, T>(self),
            DType::BF16 => convert::<half::bf16, T>(self),
            DType::F16 => convert::<half::f16, T>(self),
        }
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
    use safetensors::tensor::{Metadata, TensorInfo};

    let mut order: Vec<&(N, TensorBytes<'_>)> = tensors.iter().collect();
    order.sort_by(|(ln, lt), (rn, rt)| {
        rt.dtype
            .size_in_bytes()
            .cmp(&lt.dtype.size_in_bytes())
            .then_with(|| ln.as_ref().cmp(rn.as_ref()))
    });

    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0usize;
    for (i, (name, t)) in order.iter().enumerate() {
        let name = name.as_ref();
        if i > 0 && order[i - 1].0.as_ref() == name {
            return Err(checkpoint_error(
                path,
                format!("tensor {name:?} is given twice"),
            ));
        }
        let expected = t
            .shape
            .iter()
            .try_fold(t.dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d));
        if expected != Some(t.data.len()) {
            return Err(checkpoint_error(
                path,
                format!(
                    "tensor {name:?} of shape {:?} and dtype {} has {} bytes of data, expected {}",
                    t.shape,
                    t.dtype,
                    t.data.len(),
                    expected.map_or_else(|| "more than fit in usize".into(), |n| n.to_string())
                ),
            ));
        }
        infos.push((
            name.to_string(),
            TensorInfo {
                dtype: to_safetensors(t.dtype),
                shape: t.shape.clone(),
                data_offsets: (offset, offset + t.data.len()),
            },
        ));
        offset += t.data.len();
    }

    let metadata = Metadata::new(None, infos)?;
    let mut header = serde_json::to_vec(&metadata)?;
    // The format pads the header with spaces to a multiple of 8 bytes.
    header.resize(header.len().next_multiple_of(8), b' ');
    let write_err = |e| from_write_error(path, e);
    w.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(write_err)?;
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

/// Parses the bytes of a safetensors file (as returned by [`read_verified`])
/// into tensors by name, borrowing their data. `path` only names the file in
/// errors.
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
        let dtype = from_safetensors(view.dtype()).ok_or_else(|| {
            checkpoint_error(
                path,
                format!(
                    "tensor {name:?} has dtype {:?}; zero-rs reads F32, F64, BF16 and F16",
                    view.dtype()
                ),
            )
        })?;
        tensors.insert(
            name.to_string(),
            TensorBytes {
                dtype,
                shape: view.shape().to_vec(),
                data: view.data(),
            },
        );
    }
    Ok(tensors)
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
    /// against its record.
    ///
    /// Fails if the manifest does not list `name`, if `name` is not a plain
    /// relative path inside the directory, or as [`read_verified`] does.
    pub fn read_file(&self, dir: impl AsRef<Path>, name: &str) -> Result<Vec<u8>> {
        let dir = dir.as_ref();
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
        read_verified(dir.join(relative), &record.sha256, record.len)
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
