//! A safetensors file filled out of order: the header is fixed up front from
//! the tensors' names, dtypes and shapes, and data is written at element
//! offsets as it arrives, so the writer never holds a whole tensor.

use super::files::{checkpoint_error, hex, io_error, sync_dir, temp_beside, FileRecord};
use super::tensors::to_safetensors;
use crate::{DType, Result};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Writes one safetensors file atomically (temporary file, fsync, rename),
/// with data arriving in any order. Dropped without [`finish`] it removes
/// its temporary file.
///
/// [`finish`]: StreamingTensorFile::finish
pub(crate) struct StreamingTensorFile {
    path: PathBuf,
    temp: PathBuf,
    file: Option<File>,
    /// Per tensor: byte offset of its data in the file, byte length, dtype.
    slots: BTreeMap<String, (u64, usize, DType)>,
}

impl StreamingTensorFile {
    /// Creates the temporary file and writes the header for `specs`
    /// (name, dtype, shape); data not written later reads as zeros.
    pub(crate) fn create(path: &Path, specs: &[(String, DType, Vec<usize>)]) -> Result<Self> {
        use safetensors::tensor::{Metadata, TensorInfo};
        let mut order: Vec<&(String, DType, Vec<usize>)> = specs.iter().collect();
        // As `write_tensors`: largest elements first keeps every tensor aligned.
        order.sort_by(|l, r| {
            r.1.size_in_bytes()
                .cmp(&l.1.size_in_bytes())
                .then_with(|| l.0.cmp(&r.0))
        });
        let mut infos = Vec::with_capacity(order.len());
        let mut rel = Vec::with_capacity(order.len());
        let mut offset = 0usize;
        for (name, dtype, shape) in order {
            let bytes = shape.iter().product::<usize>() * dtype.size_in_bytes();
            infos.push((
                name.clone(),
                TensorInfo {
                    dtype: to_safetensors(*dtype),
                    shape: shape.clone(),
                    data_offsets: (offset, offset + bytes),
                },
            ));
            rel.push((name.clone(), offset, bytes, *dtype));
            offset += bytes;
        }
        let metadata = Metadata::new(None, infos)?;
        let mut header = serde_json::to_vec(&metadata)?;
        header.resize(header.len().next_multiple_of(8), b' ');
        let data_start = 8 + header.len() as u64;

        let (_, temp) = temp_beside(path)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| io_error(&temp, e))?;
        let mut this = Self {
            path: path.to_path_buf(),
            temp: temp.clone(),
            file: None,
            slots: rel
                .into_iter()
                .map(|(n, o, b, d)| (n, (data_start + o as u64, b, d)))
                .collect(),
        };
        let written = file
            .write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|()| file.write_all(&header))
            .and_then(|()| file.set_len(data_start + offset as u64));
        this.file = Some(file);
        written.map_err(|e| io_error(&temp, e))?;
        Ok(this)
    }

    /// Writes `data` (raw little-endian bytes) into tensor `name` starting
    /// at element `elem_offset`.
    pub(crate) fn write_at(&mut self, name: &str, elem_offset: usize, data: &[u8]) -> Result<()> {
        let &(start, len, dtype) = self.slots.get(name).ok_or_else(|| {
            checkpoint_error(
                &self.path,
                format!("internal: no tensor {name:?} in the header"),
            )
        })?;
        let at = elem_offset * dtype.size_in_bytes();
        if at + data.len() > len {
            return Err(checkpoint_error(
                &self.path,
                format!(
                    "internal: {} bytes at byte {at} overrun tensor {name:?} of {len} bytes",
                    data.len()
                ),
            ));
        }
        let Some(file) = self.file.as_mut() else {
            return Err(checkpoint_error(
                &self.path,
                "internal: file already closed",
            ));
        };
        file.seek(SeekFrom::Start(start + at as u64))
            .and_then(|_| file.write_all(data))
            .map_err(|e| io_error(&self.temp, e))
    }

    /// Syncs the file, hashes it, and renames it into place.
    pub(crate) fn finish(mut self) -> Result<FileRecord> {
        let Some(mut file) = self.file.take() else {
            return Err(checkpoint_error(
                &self.path,
                "internal: file already closed",
            ));
        };
        let temp = self.temp.clone();
        let record = (|| -> std::io::Result<FileRecord> {
            file.sync_all()?;
            file.seek(SeekFrom::Start(0))?;
            let mut hasher = Sha256::new();
            let mut buf = vec![0u8; 1 << 20];
            let mut len = 0u64;
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                len += n as u64;
            }
            Ok(FileRecord {
                sha256: hex(&hasher.finalize()),
                len,
            })
        })()
        .map_err(|e| io_error(&temp, e))?;
        drop(file);
        fs::rename(&temp, &self.path).map_err(|e| io_error(&self.path, e))?;
        self.temp = PathBuf::new();
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        sync_dir(&dir)?;
        Ok(record)
    }
}

impl Drop for StreamingTensorFile {
    fn drop(&mut self) {
        if !self.temp.as_os_str().is_empty() {
            // Best effort: an unfinished file is garbage.
            let _ = fs::remove_file(&self.temp);
        }
    }
}
