//! The README's library example is `examples/quickstart.rs`, which the
//! crate's doc test runs: the README shows the program the tests run.

#[test]
fn the_readmes_library_example_is_the_quickstart_example() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README.md");
    let example = include_str!("../examples/quickstart.rs");
    let block = format!("```rust\n{example}```\n");
    assert!(
        readme.contains(&block),
        "README.md's library example differs from zero-candle/examples/quickstart.rs; copy \
         the file into the README's ```rust block"
    );
}
