//! Hugging Face hub directories: `config.json`, the weights
//! (`model.safetensors`, or `model.safetensors.index.json` with its shards)
//! and the tokenizer files, read memory-mapped ([`HubDir`], [`HubSource`])
//! and written back in the same layout ([`HubLayout`],
//! `ZeroOptimizer::save_hub`).

mod layout;
mod save;
mod source;

pub use crate::optimizer::weights::Arrangement;
pub use layout::HubLayout;
pub use source::HubSource;

use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use zero_core::checkpoint::{MappedTensors, TensorBytes};

/// The single weights file of an unsharded checkpoint.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint (`weight_map`: tensor name -> file).
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The model's configuration.
pub const CONFIG_FILE: &str = "config.json";

/// A hub directory opened for reading: its configuration parsed, its weight
/// files memory-mapped (a rank reads only the elements it asks for).
pub struct HubDir {
    dir: PathBuf,
    config: serde_json::Value,
    /// The weight files' names (relative to `dir`) and mappings, in the
    /// index's order (one file when unsharded).
    files: Vec<(String, MappedTensors)>,
    /// The file (index into `files`) holding each tensor.
    tensors: BTreeMap<String, usize>,
    /// Whether the weights come through an index.
    sharded: bool,
}

impl std::fmt::Debug for HubDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubDir")
            .field("dir", &self.dir)
            .field("files", &self.files.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl HubDir {
    /// Opens `dir`: reads `config.json` and maps `model.safetensors`, or the
    /// files `model.safetensors.index.json` names. An error names the file
    /// that is missing or unreadable, or the tensor the index misplaces.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(hub_error(
                &dir,
                "is not a directory; give a Hugging Face model directory (config.json and \
                 model.safetensors), as save_pretrained writes it",
            ));
        }
        let config = read_json(&dir.join(CONFIG_FILE))?;
        refuse_quantized(&config).map_err(|detail| hub_error(&dir.join(CONFIG_FILE), detail))?;
        let index_path = dir.join(INDEX_FILE);
        let (files, tensors, sharded) = if index_path.is_file() {
            let (files, tensors) = open_index(&dir, &index_path)?;
            (files, tensors, true)
        } else {
            let path = dir.join(WEIGHTS_FILE);
            if !path.is_file() {
                return Err(hub_error(
                    &dir,
                    format!(
                        "has neither {WEIGHTS_FILE} nor {INDEX_FILE}; only safetensors weights \
                         are read (convert a pytorch_model.bin with save_pretrained)"
                    ),
                ));
            }
            let file = MappedTensors::open(&path)?;
            let tensors = file.names().map(|n| (n.to_string(), 0)).collect();
            (vec![(WEIGHTS_FILE.to_string(), file)], tensors, false)
        };
        Ok(Self {
            dir,
            config,
            files,
            tensors,
            sharded,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`, parsed.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// Whether the weights are sharded over several files through an index.
    pub fn is_sharded(&self) -> bool {
        self.sharded
    }

    /// The tensor `name`, borrowed from its file's mapping.
    pub fn tensor(&self, name: &str) -> Option<TensorBytes<'_>> {
        let &file = self.tensors.get(name)?;
        self.files[file].1.get(name)
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The weight files (names relative to the directory), each with the
    /// names of the tensors it holds, sorted.
    pub fn files(&self) -> Vec<(&str, Vec<&str>)> {
        self.files
            .iter()
            .map(|(name, file)| (name.as_str(), file.names().collect()))
            .collect()
    }
}

/// An error about a hub directory or one of its files.
pub(crate) fn hub_error(path: &Path, detail: impl Into<String>) -> Error {
    Error::Hub {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).map_err(|e| hub_error(path, format!("cannot read: {e}")))?;
    serde_json::from_str(&text).map_err(|e| hub_error(path, format!("is not valid JSON: {e}")))
}

type Files = Vec<(String, MappedTensors)>;

/// The files an index names, mapped in the order of the first tensor (by
/// name) each holds, and the file of each tensor (checked to be there).
fn open_index(dir: &Path, index_path: &Path) -> Result<(Files, BTreeMap<String, usize>)> {
    let index = read_json(index_path)?;
    let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(hub_error(
            index_path,
            "has no `weight_map` object (tensor name -> file)",
        ));
    };
    let mut files: Files = Vec::new();
    let mut tensors = BTreeMap::new();
    for (name, file_name) in map {
        let Some(file_name) = file_name.as_str() else {
            return Err(hub_error(
                index_path,
                format!("`weight_map`.{name} is not a file name"),
            ));
        };
        if file_name.contains('/') || file_name.contains('\\') || file_name.starts_with('.') {
            return Err(hub_error(
                index_path,
                format!("`weight_map`.{name} names {file_name:?}, not a file beside the index"),
            ));
        }
        let file = match files.iter().position(|(f, _)| f == file_name) {
            Some(file) => file,
            None => {
                files.push((
                    file_name.to_string(),
                    MappedTensors::open(dir.join(file_name))?,
                ));
                files.len() - 1
            }
        };
        if files[file].1.get(name).is_none() {
            return Err(hub_error(
                &dir.join(file_name),
                format!("has no tensor {name:?}, which {INDEX_FILE} places there"),
            ));
        }
        tensors.insert(name.clone(), file);
    }
    Ok((files, tensors))
}

/// An error where `config` describes quantized weights
/// (`quantization_config`: DeepSeek-V3's and Kimi K2's FP8 blocks,
/// gpt-oss's MXFP4, GPTQ, AWQ, bitsandbytes): training here reads f32,
/// f64, bf16 and f16 weights.
fn refuse_quantized(config: &serde_json::Value) -> std::result::Result<(), String> {
    let Some(quantization) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(());
    };
    let method = quantization
        .get("quant_method")
        .and_then(|m| m.as_str())
        .unwrap_or("unnamed");
    Err(format!(
        "`quantization_config` says the weights are quantized ({method:?}); fine-tuning here \
         reads f32, bf16 or f16 weights: use the model's bf16 release, or dequantize it (load it \
         with transformers, dequantized, and save_pretrained it in bf16) and remove the key"
    ))
}
