//! Compiled kernels kept on disk between processes: NVRTC takes seconds to
//! compile the layer kernels (about 16 s on a 2.3 GHz core), and every
//! process that runs them (each rank of an NCCL job, each run of the
//! trainer, each test binary) would pay it again.
//!
//! A file per compilation, named by the SHA-256 of everything that decides
//! the PTX (the source, the target architecture, the options and the NVRTC
//! version), holding a header with the SHA-256 of the PTX and the PTX. A
//! file whose PTX does not match its header (cut short, written over) is
//! ignored and compiled again; files are written whole under a temporary
//! name and renamed into place, so a process never reads one half written.
//! Nothing here fails a compilation: a cache that cannot be read or
//! written is logged and passed by.
//!
//! `ZERO_KERNEL_CACHE` names the directory; `off` (or an empty value)
//! turns the cache off. By default it is `$XDG_CACHE_HOME/zero-rs/kernels`,
//! or `$HOME/.cache/zero-rs/kernels`.

use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The first bytes of every cache file, before the PTX's SHA-256.
const MAGIC: &str = "zero-rs ptx 1 ";

/// A directory of compiled kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PtxCache {
    dir: PathBuf,
}

impl PtxCache {
    /// The cache `ZERO_KERNEL_CACHE` names (see the module's
    /// documentation), or `None` where it is off or there is no home.
    pub fn from_env() -> Option<Self> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        Self::locate(
            std::env::var_os("ZERO_KERNEL_CACHE"),
            var("XDG_CACHE_HOME"),
            var("HOME"),
        )
    }

    /// [`PtxCache::from_env`] from those variables' values.
    fn locate(
        named: Option<std::ffi::OsString>,
        xdg_cache: Option<std::ffi::OsString>,
        home: Option<std::ffi::OsString>,
    ) -> Option<Self> {
        let dir = match named {
            Some(named) if named.is_empty() || named == "off" => return None,
            Some(named) => PathBuf::from(named),
            None => match (xdg_cache, home) {
                (Some(cache), _) => Path::new(&cache).join("zero-rs").join("kernels"),
                (None, Some(home)) => Path::new(&home).join(".cache/zero-rs/kernels"),
                (None, None) => return None,
            },
        };
        Some(Self { dir })
    }

    /// A cache in `dir`.
    pub fn in_dir(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The key of a compilation: the SHA-256 (hex) of its `parts` (the
    /// source, the architecture, the options, the compiler's version),
    /// each counted with its length so that no two lists run together.
    pub fn key(parts: &[&str]) -> String {
        let mut hash = Sha256::new();
        for part in parts {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part.as_bytes());
        }
        hex(&hash.finalize())
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.ptx"))
    }

    /// The PTX stored under `key`, if there is a whole one.
    pub fn load(&self, key: &str) -> Option<String> {
        let path = self.path(key);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!("kernel cache: cannot read {}: {e}", path.display());
                return None;
            }
        };
        let whole = text
            .strip_prefix(MAGIC)
            .and_then(|rest| rest.split_once('\n'))
            .filter(|(sum, ptx)| *sum == hex(&Sha256::digest(ptx.as_bytes())));
        match whole {
            Some((_, ptx)) => Some(ptx.to_string()),
            None => {
                tracing::warn!(
                    "kernel cache: {} is not a whole entry; compiling again",
                    path.display()
                );
                None
            }
        }
    }

    /// Stores `ptx` under `key`: written to a file of its own, then renamed
    /// into place (a reader sees the old entry, none, or this one whole).
    pub fn store(&self, key: &str, ptx: &str) {
        if let Err(e) = self.try_store(key, ptx) {
            tracing::warn!(
                "kernel cache: cannot write into {}: {e} (set ZERO_KERNEL_CACHE to another \
                 directory, or to off)",
                self.dir.display()
            );
        }
    }

    fn try_store(&self, key: &str, ptx: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let temp = self.dir.join(format!(
            ".{key}.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        let written = (|| {
            let mut file = std::fs::File::create(&temp)?;
            let sum = hex(&Sha256::digest(ptx.as_bytes()));
            write!(file, "{MAGIC}{sum}\n{ptx}")?;
            file.sync_all()?;
            std::fs::rename(&temp, self.path(key))
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        written
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_round_trips_and_a_damaged_one_is_passed_by() {
        let dir = tempfile::tempdir().unwrap();
        let cache = PtxCache::in_dir(dir.path().join("kernels"));
        let key = PtxCache::key(&["source", "compute_90", "--opt", "13.0"]);
        assert_eq!(cache.load(&key), None);
        let ptx = "//\n.version 9.0\n.target sm_90\n";
        cache.store(&key, ptx);
        assert_eq!(cache.load(&key).as_deref(), Some(ptx));
        // Cut short, or another PTX under the header: compiled again.
        let path = cache.path(&key);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, &text[..text.len() - 3]).unwrap();
        assert_eq!(cache.load(&key), None);
        std::fs::write(&path, text.replace("sm_90", "sm_80")).unwrap();
        assert_eq!(cache.load(&key), None);
        std::fs::write(&path, "not an entry").unwrap();
        assert_eq!(cache.load(&key), None);
        // Stored again, whole; no temporary file is left.
        cache.store(&key, ptx);
        assert_eq!(cache.load(&key).as_deref(), Some(ptx));
        let names: Vec<_> = std::fs::read_dir(dir.path().join("kernels"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [std::ffi::OsString::from(format!("{key}.ptx"))]);
    }

    #[test]
    fn every_part_of_the_key_counts() {
        let key = PtxCache::key(&["ab", "c"]);
        assert_eq!(key.len(), 64);
        assert_ne!(key, PtxCache::key(&["a", "bc"]));
        assert_ne!(key, PtxCache::key(&["ab", "c", ""]));
        assert_eq!(key, PtxCache::key(&["ab", "c"]));
    }

    #[test]
    fn the_directory_follows_the_environment() {
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        let dir = |cache: Option<PtxCache>| cache.map(|c| c.dir);
        assert_eq!(
            dir(PtxCache::locate(os("/k"), os("/x"), os("/h"))),
            Some("/k".into())
        );
        assert_eq!(PtxCache::locate(os("off"), os("/x"), os("/h")), None);
        assert_eq!(PtxCache::locate(os(""), None, os("/h")), None);
        assert_eq!(
            dir(PtxCache::locate(None, os("/x"), os("/h"))),
            Some("/x/zero-rs/kernels".into())
        );
        assert_eq!(
            dir(PtxCache::locate(None, None, os("/h"))),
            Some("/h/.cache/zero-rs/kernels".into())
        );
        assert_eq!(PtxCache::locate(None, None, None), None);
    }

    #[test]
    fn an_unwritable_cache_is_passed_by() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the directory should be.
        let blocked = dir.path().join("file");
        std::fs::write(&blocked, "x").unwrap();
        let cache = PtxCache::in_dir(&blocked);
        cache.store("k", "ptx");
        assert_eq!(cache.load("k"), None);
    }
}
