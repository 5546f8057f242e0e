//! The docs say what is there: the README's first program is
//! `examples/quickstart.rs` (which the crate's doc test runs), every file
//! the README and the `docs/` pages link to or name exists, and every file,
//! type and function ARCHITECTURE.md names is in the workspace.

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

/// Every `.rs` file below `dir`, `target/` and hidden folders aside, and
/// the names of every file and folder there.
fn sources(dir: &Path, out: &mut Vec<PathBuf>, names: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("a folder").flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() && name != "target" && !name.starts_with('.') {
            sources(&path, out, names);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
        names.push(name);
    }
}

/// The words of `text` made of identifier characters.
fn words(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

/// ARCHITECTURE.md describes the code as it is: every source file it names
/// exists, and every type (a CamelCase word in backquotes) and function or
/// field (a snake_case word followed by `(`, or alone in backquotes) is
/// defined somewhere in the workspace, or is one of the outside names it
/// refers to.
#[test]
fn every_file_type_and_function_architecture_names_exists() {
    const OUTSIDE: &[&str] = &["GradStore", "VarBuilder", "ZeroRedundancyOptimizer"];
    let root = root();
    let (mut files, mut names) = (Vec::new(), Vec::new());
    sources(&root, &mut files, &mut names);
    let code: String = files.iter().map(|f| read(f)).collect::<Vec<_>>().join("\n");
    // Identifiers in the code, and files and folders by name or stem.
    let mut defined: std::collections::HashSet<&str> = words(&code).collect();
    defined.extend(names.iter().map(|n| n.split('.').next().unwrap_or(n)));
    let text = read(&root.join("ARCHITECTURE.md"));
    let mut missing = Vec::new();
    for (i, quoted) in text.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        if quoted.contains('*') {
            continue; // a pattern
        }
        if quoted.ends_with(".rs") && !quoted.contains(' ') {
            let file = quoted.rsplit('/').next().unwrap_or(quoted);
            if !names.iter().any(|n| n == file) {
                missing.push(format!("file {quoted}"));
            }
            continue;
        }
        for word in words(quoted) {
            let camel = word.chars().next().is_some_and(char::is_uppercase)
                && word.chars().skip(1).any(char::is_uppercase)
                && word.chars().any(char::is_lowercase);
            let snake = word.contains('_')
                && !word.starts_with('_')
                && !word.ends_with('_')
                && word.chars().all(|c| !c.is_uppercase());
            if (camel || snake) && !defined.contains(word) && !OUTSIDE.contains(&word) {
                missing.push(format!("name {word} (in `{quoted}`)"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names what is not there: {missing:#?}"
    );
}
