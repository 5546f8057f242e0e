//! The README and the `docs/` pages say what is there: the README's first
//! program is `examples/quickstart.rs` (which the crate's doc test runs),
//! and every file they link to or name exists.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_readmes_first_program_is_the_quickstart_example() {
    let readme = read(&root().join("README.md"));
    let example = include_str!("../examples/quickstart.rs");
    let block = format!("```rust\n{example}```\n");
    assert!(
        readme.contains(&block),
        "README.md's first program differs from zero-candle/examples/quickstart.rs; copy \
         the file into the README's ```rust block"
    );
}

/// The relative links (`[text](target)`) and the backquoted paths with a
/// folder and an extension (`` `zero-candle/tests/x.rs` ``) of a page.
fn named_files(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for part in text.split("](").skip(1) {
        let target = part.split(')').next().unwrap_or("");
        let target = target.split('#').next().unwrap_or("");
        if !target.is_empty() && !target.contains("://") {
            out.push(target.to_string());
        }
    }
    for (i, part) in text.split('`').enumerate() {
        let is_path = i % 2 == 1
            && part.contains('/')
            && !part.contains(' ')
            && !part.contains("::")
            && [".rs", ".md", ".sh", ".py"]
                .iter()
                .any(|e| part.ends_with(e));
        if is_path {
            out.push(part.to_string());
        }
    }
    out
}

#[test]
fn every_file_the_readme_and_the_docs_name_exists() {
    let root = root();
    let mut pages = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        pages.push(entry.expect("an entry").path());
    }
    let mut missing = Vec::new();
    for page in &pages {
        let dir = page.parent().expect("a folder");
        for name in named_files(&read(page)) {
            // Links are relative to the page; named paths to the page or
            // to the project's root.
            if !dir.join(&name).exists() && !root.join(&name).exists() {
                missing.push(format!("{} names {name}", page.display()));
            }
        }
    }
    assert!(missing.is_empty(), "{missing:#?}");
}
