//! File primitives for checkpoints: atomic writes (a killed write leaves
//! no partial file under the real name) and verified reads.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What was written to a file: its SHA-256 and length, as recorded in the
/// [`Manifest`](super::Manifest) and checked by [`read_verified`].
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
pub(super) struct HashingWriter<W> {
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
pub(super) fn remove_interrupted_writes(dir: &Path) {
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
pub(super) struct AtomicFile {
    pub(super) path: PathBuf,
    dir: PathBuf,
    temp: TempGuard,
    pub(super) writer: HashingWriter<BufWriter<File>>,
}

impl AtomicFile {
    pub(super) fn create(path: &Path) -> Result<Self> {
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
    pub(super) fn commit(self) -> Result<FileRecord> {
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
pub(super) fn from_write_error(path: &Path, e: io::Error) -> Error {
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
pub(super) fn open_recorded(path: &Path) -> Result<File> {
    match File::open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(checkpoint_error(
            path,
            "file is missing; was the checkpoint copied completely?",
        )),
        Err(e) => Err(io_error(path, e)),
    }
}

pub(super) fn check_len(path: &Path, found: u64, expected: u64) -> Result<()> {
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

pub(super) fn check_sha256(path: &Path, hasher: Sha256, expected: &str) -> Result<()> {
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
/// [`Manifest::map_file`](super::Manifest::map_file).
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
}
