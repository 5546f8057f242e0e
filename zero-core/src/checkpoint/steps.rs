//! Checkpoints kept by step: `DIR/step-000123/` per save, and `DIR/latest`
//! naming the newest complete one, so that a job that restarts finds it.

use super::files::{checkpoint_error, io_error, remove_interrupted_writes, sync_dir};
use super::{write_atomic, MANIFEST_FILE};
use crate::Result;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The file of a [`StepCheckpoints`] directory that names its latest
/// complete step directory (`step-000123` and a newline).
pub const LATEST_FILE: &str = "latest";

/// A directory of checkpoints kept by step: each save goes into a
/// directory of its own, `DIR/step-000123` (six digits at least, so that
/// names sort by step), and `DIR/latest` names the newest complete one.
///
/// A step directory is complete once it holds its `manifest.json`, the
/// commit point of a save; [`commit`](StepCheckpoints::commit) then points
/// `latest` at it (atomically: a file written beside it, fsynced and
/// renamed), and [`prune`](StepCheckpoints::prune) removes older ones. A
/// process killed at any moment leaves `latest` on a complete checkpoint.
/// One rank (rank 0) commits and prunes, after the save has returned on
/// every rank; [`resolve`](StepCheckpoints::resolve) finds what to resume
/// from.
///
/// ```
/// # fn main() -> zero_core::Result<()> {
/// # let root = std::env::temp_dir().join(format!("zero-doc-steps-{}", std::process::id()));
/// use zero_core::checkpoint::{Manifest, StepCheckpoints};
/// let checkpoints = StepCheckpoints::new(&root);
/// for step in [10, 20, 30] {
///     let dir = checkpoints.next_dir(step);
///     // opt.save_checkpoint(&dir)? on every rank; here, an empty checkpoint.
///     # std::fs::create_dir_all(&dir).unwrap();
///     Manifest::new().save(&dir)?;
///     // Then, on rank 0:
///     checkpoints.commit(step)?;
///     checkpoints.prune(2)?;
/// }
/// assert_eq!(checkpoints.latest()?, Some(root.join("step-000030")));
/// assert_eq!(checkpoints.complete()?.len(), 2);
/// // What `--resume DIR` loads: the latest complete step.
/// assert_eq!(StepCheckpoints::resolve(&root)?, root.join("step-000030"));
/// # std::fs::remove_dir_all(&root).unwrap();
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepCheckpoints {
    dir: PathBuf,
}

impl StepCheckpoints {
    /// The checkpoints kept in `dir` (created by the first save).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory that holds the step directories.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the checkpoint of `step` goes: `DIR/step-000123`. Save into
    /// it on every rank, then [`commit`](StepCheckpoints::commit) it.
    pub fn next_dir(&self, step: u64) -> PathBuf {
        self.dir.join(step_name(step))
    }

    /// Points `DIR/latest` at the checkpoint of `step`, which must be
    /// complete (its manifest written: call this after the save returned).
    /// The file is replaced atomically, so `latest` names the previous
    /// checkpoint until this one is durable. Returns the step directory.
    pub fn commit(&self, step: u64) -> Result<PathBuf> {
        let dir = self.next_dir(step);
        if !is_complete(&dir) {
            return Err(checkpoint_error(
                &dir,
                format!(
                    "has no manifest: the save of step {step} did not complete; commit a step \
                     only after its save returned on every rank"
                ),
            ));
        }
        // A `latest` written by a process killed mid-write leaves its
        // temporary file here; nothing else would remove it.
        remove_interrupted_writes(&self.dir);
        write_atomic(self.dir.join(LATEST_FILE), |w| {
            writeln!(w, "{}", step_name(step))
        })?;
        Ok(dir)
    }

    /// [`commit`](StepCheckpoints::commit) of the step directory `dir`, as
    /// [`next_dir`](StepCheckpoints::next_dir) named it: what a background
    /// save gives back once complete
    /// ([`SavedCheckpoint::dir`](crate::engine::SavedCheckpoint::dir)).
    pub fn commit_dir(&self, dir: &Path) -> Result<PathBuf> {
        let step = dir
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(parse_step_name)
            .filter(|&step| self.next_dir(step) == dir)
            .ok_or_else(|| {
                checkpoint_error(
                    dir,
                    format!(
                        "is not a step directory of {}; commit the directories its next_dir \
                         names",
                        self.dir.display()
                    ),
                )
            })?;
        self.commit(step)
    }

    /// The complete step checkpoints, by step (oldest first).
    pub fn complete(&self) -> Result<Vec<(u64, PathBuf)>> {
        Ok(self
            .step_dirs()?
            .into_iter()
            .filter(|(_, dir)| is_complete(dir))
            .collect())
    }

    /// The latest complete checkpoint: the one `DIR/latest` names, or, if
    /// that is missing or names an incomplete one, the complete step
    /// directory of the highest step. `None` if there is none (or no
    /// `DIR`).
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        if let Some(step) = self.latest_named()? {
            let dir = self.next_dir(step);
            if is_complete(&dir) {
                return Ok(Some(dir));
            }
            tracing::warn!(
                "{} names {}, which is incomplete; taking the highest complete step instead",
                self.dir.join(LATEST_FILE).display(),
                dir.display()
            );
        }
        Ok(self.complete()?.pop().map(|(_, dir)| dir))
    }

    /// The step `DIR/latest` names, if it names one.
    fn latest_named(&self) -> Result<Option<u64>> {
        let path = self.dir.join(LATEST_FILE);
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(&path, e)),
        };
        let step = parse_step_name(text.trim());
        if step.is_none() {
            tracing::warn!(
                "{} holds {:?}, not a step directory's name; ignoring it",
                path.display(),
                text.trim()
            );
        }
        Ok(step)
    }

    /// Keeps the `keep` newest complete checkpoints up to the latest (the
    /// one [`latest`](StepCheckpoints::latest) returns, always kept) and
    /// removes the older ones, complete or not (an incomplete one older
    /// than the latest is a save that was interrupted). Step directories
    /// newer than the latest are left alone: a save in progress, or the
    /// future of a run resumed from an earlier step (remove those
    /// yourself). Returns the directories removed.
    ///
    /// Each is renamed to a hidden name first, so that a process killed
    /// while removing it never leaves a `step-` directory with part of its
    /// files; the next prune removes what such a kill left.
    pub fn prune(&self, keep: usize) -> Result<Vec<PathBuf>> {
        if keep == 0 {
            return Err(checkpoint_error(
                &self.dir,
                "prune(0) would remove the latest checkpoint; keep at least 1",
            ));
        }
        self.remove_interrupted_prunes();
        let Some(latest) = self.latest()? else {
            return Ok(Vec::new());
        };
        let latest_step = latest
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_step_name)
            .ok_or_else(|| checkpoint_error(&latest, "not a step directory"))?;
        let mut kept = 0;
        let mut removed = Vec::new();
        // Newest first, so that the first `keep` complete ones stay.
        for (step, dir) in self.step_dirs()?.into_iter().rev() {
            if step > latest_step {
                continue;
            }
            if is_complete(&dir) && kept < keep {
                kept += 1;
                continue;
            }
            let hidden = self.dir.join(format!(".{}.removing", step_name(step)));
            fs::rename(&dir, &hidden).map_err(|e| io_error(&dir, e))?;
            // Durable before any file goes: a crash must not bring back
            // the name with part of the files.
            sync_dir(&self.dir)?;
            fs::remove_dir_all(&hidden).map_err(|e| io_error(&hidden, e))?;
            removed.push(dir);
        }
        Ok(removed)
    }

    /// Removes what a prune killed part-way left (`.step-N.removing`).
    fn remove_interrupted_prunes(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let interrupted = name
                .strip_prefix('.')
                .and_then(|n| n.strip_suffix(".removing"))
                .is_some_and(|n| parse_step_name(n).is_some());
            if interrupted {
                if let Err(e) = fs::remove_dir_all(entry.path()) {
                    tracing::debug!(
                        "cannot remove {}, left by an interrupted prune: {e}",
                        entry.path().display()
                    );
                }
            }
        }
    }

    /// Every `step-N` directory, complete or not, by step.
    fn step_dirs(&self) -> Result<Vec<(u64, PathBuf)>> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error(&self.dir, e)),
        };
        let mut dirs = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_error(&self.dir, e))?;
            let step = entry.file_name().to_str().and_then(parse_step_name);
            if let Some(step) = step {
                if entry.path().is_dir() {
                    dirs.push((step, entry.path()));
                }
            }
        }
        dirs.sort();
        Ok(dirs)
    }

    /// The checkpoint directory a resume from `path` loads: the latest
    /// complete step checkpoint if `path` holds any, else `path` itself if
    /// it holds a manifest (a named step directory, `DIR/step-000123`, or
    /// a checkpoint saved straight into a directory of its own).
    ///
    /// Fails, saying so, if `path` does not exist, is a file or holds neither.
    pub fn resolve(path: impl AsRef<Path>) -> Result<PathBuf> {
        let path = path.as_ref();
        if path.exists() && !path.is_dir() {
            return Err(checkpoint_error(
                path,
                "is a file, not a checkpoint directory; give the --checkpoint-dir of the run to \
                 resume, or one of its step-<N> directories",
            ));
        }
        if let Some(latest) = Self::new(path).latest()? {
            return Ok(latest);
        }
        if is_complete(path) {
            return Ok(path.to_path_buf());
        }
        let detail = if path.is_dir() {
            "holds no manifest and no complete step-<N> checkpoint; is it a zero-rs checkpoint \
             directory, and did a save finish?"
        } else {
            "does not exist; give the --checkpoint-dir of the run to resume, or one of its \
             step-<N> directories"
        };
        Err(checkpoint_error(path, detail))
    }
}

/// Whether `dir` holds a manifest, the last file a save writes.
fn is_complete(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

/// `step-000123`.
fn step_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// The step of a `step-<digits>` name.
fn parse_step_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Manifest;

    /// A complete checkpoint of `step` (an empty manifest is enough here).
    fn save(checkpoints: &StepCheckpoints, step: u64) -> PathBuf {
        let dir = checkpoints.next_dir(step);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("model.safetensors"), b"weights").unwrap();
        Manifest::new().save(&dir).unwrap();
        dir
    }

    /// A save killed before its manifest.
    fn interrupted(checkpoints: &StepCheckpoints, step: u64) -> PathBuf {
        let dir = checkpoints.next_dir(step);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("model.safetensors"), b"part").unwrap();
        dir
    }

    fn steps(checkpoints: &StepCheckpoints) -> Vec<u64> {
        let complete = checkpoints.complete().unwrap();
        complete.into_iter().map(|(s, _)| s).collect()
    }

    #[test]
    fn names_are_zero_padded_and_parse_back() {
        let checkpoints = StepCheckpoints::new("d");
        assert_eq!(checkpoints.next_dir(123), Path::new("d/step-000123"));
        assert_eq!(
            checkpoints.next_dir(12_345_678),
            Path::new("d/step-12345678")
        );
        assert_eq!(parse_step_name("step-000123"), Some(123));
        assert_eq!(parse_step_name("step-12345678"), Some(12_345_678));
        for other in [
            "step-", "step-12a", "step--1", "Step-1", "step-1/", "latest",
        ] {
            assert_eq!(parse_step_name(other), None, "{other}");
        }
    }

    #[test]
    fn latest_follows_commits_and_ignores_an_uncommitted_save() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = StepCheckpoints::new(root.path().join("ckpt"));
        assert_eq!(checkpoints.latest().unwrap(), None);
        let first = save(&checkpoints, 5);
        assert_eq!(checkpoints.commit(5).unwrap(), first);
        assert_eq!(checkpoints.latest().unwrap(), Some(first.clone()));
        assert_eq!(
            fs::read_to_string(checkpoints.dir().join(LATEST_FILE)).unwrap(),
            "step-000005\n"
        );
        // Complete but not committed yet (killed between the manifest and
        // `latest`): `latest` still names step 5.
        let second = save(&checkpoints, 10);
        assert_eq!(checkpoints.latest().unwrap(), Some(first));
        checkpoints.commit(10).unwrap();
        assert_eq!(checkpoints.latest().unwrap(), Some(second.clone()));
        // A save killed before its manifest cannot be committed.
        interrupted(&checkpoints, 15);
        let err = checkpoints.commit(15).unwrap_err().to_string();
        assert!(err.contains("did not complete"), "{err}");
        assert_eq!(checkpoints.latest().unwrap(), Some(second));
        assert_eq!(steps(&checkpoints), vec![5, 10]);
    }

    #[test]
    fn latest_falls_back_to_the_highest_complete_step() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = StepCheckpoints::new(root.path());
        save(&checkpoints, 3);
        let nine = save(&checkpoints, 9);
        interrupted(&checkpoints, 12);
        // No `latest` (a crash before the first commit, or a copy without it).
        assert_eq!(checkpoints.latest().unwrap(), Some(nine.clone()));
        // `latest` naming an incomplete step, or holding garbage.
        for text in ["step-000012\n", "step-000099\n", "../elsewhere\n", ""] {
            fs::write(root.path().join(LATEST_FILE), text).unwrap();
            assert_eq!(
                checkpoints.latest().unwrap(),
                Some(nine.clone()),
                "{text:?}"
            );
        }
        // `latest` wins over a higher step it does not name (a run resumed
        // from an earlier step).
        checkpoints.commit(3).unwrap();
        assert_eq!(
            checkpoints.latest().unwrap(),
            Some(root.path().join("step-000003"))
        );
    }

    #[test]
    fn prune_keeps_the_newest_up_to_the_latest() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = StepCheckpoints::new(root.path());
        assert!(checkpoints.prune(0).is_err());
        assert_eq!(checkpoints.prune(1).unwrap(), Vec::<PathBuf>::new());
        for step in [1, 2, 3, 4] {
            save(&checkpoints, step);
        }
        interrupted(&checkpoints, 0);
        checkpoints.commit(3).unwrap();
        // A save in progress (newer than the latest) is never touched.
        let in_progress = interrupted(&checkpoints, 7);
        let removed = checkpoints.prune(2).unwrap();
        assert_eq!(
            removed,
            vec![checkpoints.next_dir(1), checkpoints.next_dir(0)]
        );
        assert_eq!(steps(&checkpoints), vec![2, 3, 4]);
        assert!(in_progress.is_dir());
        checkpoints.commit(4).unwrap();
        checkpoints.prune(1).unwrap();
        assert_eq!(steps(&checkpoints), vec![4]);
        assert!(in_progress.is_dir());
        let mut names: Vec<_> = fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["latest", "step-000004", "step-000007"]);
    }

    #[test]
    fn prune_finishes_a_removal_a_kill_interrupted() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = StepCheckpoints::new(root.path());
        save(&checkpoints, 1);
        checkpoints.commit(1).unwrap();
        let leftover = root.path().join(".step-000000.removing");
        fs::create_dir_all(&leftover).unwrap();
        fs::write(leftover.join("model.safetensors"), b"w").unwrap();
        // And a `latest` being written when the process died.
        let temp = root.path().join(".latest.tmp.1.0");
        fs::write(&temp, b"step-").unwrap();
        checkpoints.prune(1).unwrap();
        assert!(!leftover.exists());
        save(&checkpoints, 2);
        checkpoints.commit(2).unwrap();
        assert!(!temp.exists());
    }

    #[test]
    fn resolve_takes_the_latest_a_named_step_or_a_single_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = StepCheckpoints::new(root.path().join("ckpt"));
        let missing = StepCheckpoints::resolve(checkpoints.dir()).unwrap_err();
        assert!(missing.to_string().contains("does not exist"), "{missing}");
        let file = root.path().join("a-file");
        fs::write(&file, b"x").unwrap();
        let not_a_dir = StepCheckpoints::resolve(&file).unwrap_err();
        assert!(not_a_dir.to_string().contains("is a file"), "{not_a_dir}");
        let three = save(&checkpoints, 3);
        checkpoints.commit(3).unwrap();
        let six = save(&checkpoints, 6);
        checkpoints.commit(6).unwrap();
        assert_eq!(StepCheckpoints::resolve(checkpoints.dir()).unwrap(), six);
        assert_eq!(StepCheckpoints::resolve(&three).unwrap(), three);
        // A checkpoint saved straight into a directory (before step
        // directories), and one that also holds newer step directories.
        let single = root.path().join("single");
        fs::create_dir_all(&single).unwrap();
        Manifest::new().save(&single).unwrap();
        assert_eq!(StepCheckpoints::resolve(&single).unwrap(), single);
        let newer = save(&StepCheckpoints::new(&single), 8);
        assert_eq!(StepCheckpoints::resolve(&single).unwrap(), newer);
        // Neither.
        let empty = interrupted(&checkpoints, 9);
        let err = StepCheckpoints::resolve(&empty).unwrap_err().to_string();
        assert!(err.contains("no complete step-<N> checkpoint"), "{err}");
    }
}
