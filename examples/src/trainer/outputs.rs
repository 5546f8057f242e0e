//! Where a run writes what it trained (`--save`, `--plot`, `--save-hf` at
//! its end, `--checkpoint-dir` along the way), checked before it trains: a
//! path that cannot be written would otherwise fail after the run, or at
//! its first checkpoint, and lose what it trained.

use super::{Args, TrainError};
use std::path::{Path, PathBuf};

/// Fails, naming the flag and what to do, where `--save`, `--plot`,
/// `--save-hf` or `--checkpoint-dir` could not be written: a file path
/// that is a folder, a file's folder that does not exist, a folder (or the
/// nearest existing one above it) that is a file, or a folder this process
/// cannot create files in (tried with a file of its own, removed at once).
/// Runs on rank 0 (the one rank that writes the end's files; checkpoints
/// go to one folder that every rank writes into).
pub(super) fn check_outputs(args: &Args) -> Result<(), TrainError> {
    for (flag, path) in [("--save", &args.save), ("--plot", &args.plot)] {
        let Some(path) = path else { continue };
        if path.is_dir() {
            return Err(unwritable(flag, path, "is a folder; give a file's path"));
        }
        let folder = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        if !folder.exists() {
            let why = format!(
                "its folder {} does not exist; create it first",
                folder.display()
            );
            return Err(unwritable(flag, path, &why));
        }
        writable_folder(flag, path, folder)?;
    }
    for (flag, dir) in [
        ("--save-hf", &args.save_hf),
        ("--checkpoint-dir", &args.checkpoint_dir),
    ] {
        if let Some(dir) = dir {
            check_folder(flag, dir)?;
        }
    }
    Ok(())
}

/// A folder written into (created with its parents if missing): the
/// nearest of it and its ancestors that exists must be a folder this
/// process can write.
fn check_folder(flag: &str, dir: &Path) -> Result<(), TrainError> {
    let existing = dir
        .ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.exists())
        .unwrap_or(Path::new("."));
    writable_folder(flag, dir, existing)
}

/// Whether `folder`, which exists, is a folder a file can be created in (a
/// temporary one, removed).
fn writable_folder(flag: &str, path: &Path, folder: &Path) -> Result<(), TrainError> {
    if !folder.is_dir() {
        let why = format!("{} is a file, not a folder", folder.display());
        return Err(unwritable(flag, path, &why));
    }
    tempfile::Builder::new()
        .prefix(".train-write-check")
        .tempfile_in(folder)
        .map(drop)
        .map_err(|e| {
            unwritable(
                flag,
                path,
                &format!("cannot create files in {}: {e}", folder.display()),
            )
        })
}

fn unwritable(flag: &str, path: &Path, why: &str) -> TrainError {
    TrainError::Data {
        path: PathBuf::from(path),
        detail: format!(
            "{flag} cannot be written there: {why} (checked before training, so that the \
             run's result is not lost at its end)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["train"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("flags parse")
    }

    fn refused(extra: &[&str]) -> String {
        match check_outputs(&args(extra)) {
            Err(e) => e.to_string(),
            Ok(()) => panic!("{extra:?} passed the check"),
        }
    }

    #[test]
    fn writable_paths_pass_and_leave_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("w.safetensors");
        let plot = dir.path().join("loss.png");
        let hf = dir.path().join("new").join("model");
        let checkpoints = dir.path().join("checkpoints");
        let extra = [
            "--save",
            file.to_str().unwrap(),
            "--plot",
            plot.to_str().unwrap(),
            "--save-hf",
            hf.to_str().unwrap(),
            "--checkpoint-dir",
            checkpoints.to_str().unwrap(),
        ];
        check_outputs(&args(&extra)).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // No output flags: nothing to check.
        check_outputs(&args(&[])).unwrap();
    }

    #[test]
    fn unwritable_paths_are_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let missing = dir.path().join("missing").join("w.safetensors");
        let under_file = file.join("loss.png");
        let folder = dir.path().to_str().unwrap();

        let e = refused(&["--save", missing.to_str().unwrap()]);
        assert!(e.contains("--save") && e.contains("does not exist"), "{e}");
        let e = refused(&["--save", folder]);
        assert!(e.contains("--save") && e.contains("is a folder"), "{e}");
        let e = refused(&["--plot", under_file.to_str().unwrap()]);
        assert!(e.contains("--plot") && e.contains("not a folder"), "{e}");
        let e = refused(&["--save-hf", file.join("out").to_str().unwrap()]);
        assert!(e.contains("--save-hf") && e.contains("is a file"), "{e}");
        let e = refused(&["--checkpoint-dir", file.to_str().unwrap()]);
        assert!(
            e.contains("--checkpoint-dir") && e.contains("is a file"),
            "{e}"
        );
    }
}
