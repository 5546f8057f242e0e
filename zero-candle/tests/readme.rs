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

/// Names of the world outside the workspace that the docs refer to:
/// Candle's, PyTorch's and rustdoc's (MPI's functions, `MPI_*`, too).
const OUTSIDE: &[&str] = &[
    "GradStore",
    "VarBuilder",
    "ZeroRedundancyOptimizer",
    "RMSprop",
    "hook_with_zero_step",
    "max_memory_allocated",
    "scaled_dot_product_attention",
    "is_causal",
    "no_run",
];

/// The workspace's sources and what they define: the identifiers of the
/// code (comments aside), and every file and folder by name or stem.
struct Workspace {
    files: Vec<PathBuf>,
    names: Vec<String>,
    defined: std::collections::HashSet<String>,
}

impl Workspace {
    fn read() -> Self {
        let (mut files, mut names) = (Vec::new(), Vec::new());
        sources(&root(), &mut files, &mut names);
        let code = files
            .iter()
            .flat_map(|f| {
                let text = read(f);
                let lines: Vec<String> = text
                    .lines()
                    .map(|l| l.split("//").next().unwrap_or("").to_string())
                    .collect();
                lines
            })
            .collect::<Vec<_>>()
            .join("\n");
        let mut defined: std::collections::HashSet<String> =
            words(&code).map(str::to_string).collect();
        defined.extend(
            names
                .iter()
                .map(|n| n.split('.').next().unwrap_or(n).to_string()),
        );
        Self {
            files,
            names,
            defined,
        }
    }

    /// The names in `text`'s backquotes that are nowhere in the workspace:
    /// `.rs` files, CamelCase types and snake_case functions or fields.
    fn missing(&self, text: &str) -> Vec<String> {
        let mut missing = Vec::new();
        for (i, quoted) in text.split('`').enumerate() {
            if i % 2 == 0 || quoted.contains('*') {
                continue; // outside quotes, or a pattern
            }
            if quoted.ends_with(".rs") && !quoted.contains(' ') {
                let file = quoted.rsplit('/').next().unwrap_or(quoted);
                if !self.names.iter().any(|n| n == file) {
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
                let outside = OUTSIDE.contains(&word) || word.starts_with("MPI_");
                if (camel || snake) && !self.defined.contains(word) && !outside {
                    missing.push(format!("{word} (in `{quoted}`)"));
                }
            }
        }
        missing
    }
}

/// ARCHITECTURE.md describes the code as it is: every source file, type
/// and function or field it names is in the workspace.
#[test]
fn every_file_type_and_function_architecture_names_exists() {
    let workspace = Workspace::read();
    let missing = workspace.missing(&read(&root().join("ARCHITECTURE.md")));
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names what is not there: {missing:#?}"
    );
}

/// The module docs (`//!`) name only what exists.
#[test]
fn every_name_in_the_module_docs_exists() {
    let workspace = Workspace::read();
    let mut missing = Vec::new();
    for file in &workspace.files {
        let text = read(file);
        let docs: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("//!"))
            .collect();
        for name in workspace.missing(&docs.join("\n")) {
            missing.push(format!("{}: {name}", file.display()));
        }
    }
    assert!(
        missing.is_empty(),
        "module docs name what is not there: {missing:#?}"
    );
}
