//! The kernels' disk cache through a real NVRTC compile, without a GPU
//! (`scripts/check-nvrtc.sh` runs it with `--ignored`): a compile stores its
//! PTX under `ZERO_KERNEL_CACHE`, whole, and the entry is what the compile
//! returned. One test in its own binary: the cache directory is set for the
//! process before its first compile.
#![cfg(feature = "cuda")]

use zero_nccl::kernels::compile_ptx_for;
use zero_nccl::ptx_cache::PtxCache;

#[test]
#[ignore = "needs NVRTC: run scripts/check-nvrtc.sh"]
fn a_compile_stores_its_ptx_in_the_cache_directory() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::env::set_var("ZERO_KERNEL_CACHE", dir.path());
    let ptx = compile_ptx_for("compute_80")
        .unwrap_or_else(|e| panic!("no usable NVRTC ({e}); run scripts/check-nvrtc.sh"))
        .to_src();
    let entries: Vec<_> = std::fs::read_dir(dir.path())
        .expect("the cache directory was made")
        .map(|e| e.expect("an entry").path())
        .collect();
    assert_eq!(
        entries.len(),
        1,
        "one entry, no temporary file: {entries:?}"
    );
    let key = entries[0]
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("a key");
    assert_eq!(key.len(), 64, "a SHA-256 key: {key}");
    let stored = PtxCache::in_dir(dir.path()).load(key);
    assert_eq!(stored.as_deref(), Some(ptx.as_str()));
    // A second compile in this process is the one it already has.
    assert_eq!(compile_ptx_for("compute_80").unwrap().to_src(), ptx);
}
