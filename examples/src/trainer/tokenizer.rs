//! A Hugging Face `tokenizer.json` (GPT-2's byte-level BPE and the like)
//! that turns text into the token ids a pretrained model was trained on.

use crate::trainer::TrainError;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// The names a tokenizer may give its end-of-text token, most specific
/// first: GPT-2's, then the end-of-sequence names of other families.
const END_OF_TEXT_NAMES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

/// A tokenizer read from a `tokenizer.json`, encoding and decoding as
/// `transformers` does by default (`tokenizer(text)["input_ids"]` and
/// `tokenizer.decode(ids)`).
#[derive(Clone, Debug)]
pub struct TextTokenizer {
    tokenizer: Tokenizer,
    path: PathBuf,
}

impl TextTokenizer {
    /// Reads `path`, a Hugging Face `tokenizer.json`. Truncation and
    /// padding saved in the file are turned off: the trainer encodes whole
    /// documents and cuts windows itself.
    pub fn from_file(path: &Path) -> Result<Self, TrainError> {
        let data_error = |detail: String| TrainError::Data {
            path: path.to_path_buf(),
            detail,
        };
        let json = std::fs::read(path).map_err(|e| {
            data_error(format!(
                "cannot read the tokenizer: {e}; a Hugging Face model directory holds it as \
                 tokenizer.json"
            ))
        })?;
        let mut tokenizer = Tokenizer::from_bytes(&json).map_err(|e| {
            data_error(format!(
                "not a tokenizer this build can read: {e}; is it a Hugging Face tokenizer.json \
                 (saved by `tokenizers` or `save_pretrained`)?"
            ))
        })?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| data_error(format!("cannot turn off its truncation: {e}")))?;
        tokenizer.with_padding(None);
        Ok(Self {
            tokenizer,
            path: path.to_path_buf(),
        })
    }

    /// The token ids of `text`. Special tokens written in the text (such as
    /// `<|endoftext|>`) become their ids, and the tokenizer's post-processor
    /// adds what it adds by default (nothing for GPT-2).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| self.error(format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TrainError> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| self.error(format!("cannot decode {} token ids: {e}", ids.len())))
    }

    /// The number of tokens, added (special) tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The token that ends a document: `<|endoftext|>` if the vocabulary
    /// has it, else `</s>`, `<|end_of_text|>` or `<eos>`; `None` when it has
    /// none of these.
    pub fn end_of_text(&self) -> Option<u32> {
        END_OF_TEXT_NAMES
            .iter()
            .find_map(|name| self.tokenizer.token_to_id(name))
    }

    /// The `tokenizer.json` this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, detail: String) -> TrainError {
        TrainError::Data {
            path: self.path.clone(),
            detail,
        }
    }
}

/// The tiny GPT-2 fixture that `zero-candle/tests/fixtures/gpt2/make_fixtures.py`
/// made with `transformers` (its README says how), shared by the tests here
/// and in `text.rs`.
#[cfg(test)]
pub(crate) mod fixture {
    use super::TextTokenizer;
    use std::path::{Path, PathBuf};

    /// A file of the fixture folder.
    pub fn path(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../zero-candle/tests/fixtures/gpt2")
            .join(name)
    }

    /// The tiny GPT-2's tokenizer: 384 tokens, `<|endoftext|>` is id 0.
    pub fn tiny() -> TextTokenizer {
        TextTokenizer::from_file(&path("tiny/tokenizer.json")).unwrap()
    }

    /// The tiny tokenizer with `<|endoftext|>` renamed `name`, written to
    /// `dir/tokenizer.json` (replacing what is there) and read back.
    pub fn renamed_end_of_text(dir: &Path, name: &str) -> TextTokenizer {
        let json = std::fs::read_to_string(path("tiny/tokenizer.json")).unwrap();
        let file = dir.join("tokenizer.json");
        std::fs::write(&file, json.replace("<|endoftext|>", name)).unwrap();
        TextTokenizer::from_file(&file).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::fixture::{path as fixture, renamed_end_of_text, tiny};
    use super::*;

    #[test]
    fn ids_and_decodes_match_transformers() {
        let tokenizer = tiny();
        let json = std::fs::read(fixture("tokens.json")).unwrap();
        let golden: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(tokenizer.vocab_size() as u64, golden["vocab_size"]);
        assert_eq!(
            tokenizer.end_of_text().map(u64::from),
            golden["eot_id"].as_u64()
        );
        let cases = golden["cases"].as_array().unwrap();
        assert!(cases.len() >= 4, "tokens.json has {} cases", cases.len());
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(tokenizer.encode(text).unwrap(), ids, "ids of {text:?}");
            assert_eq!(
                tokenizer.decode(&ids).unwrap(),
                case["decoded"].as_str().unwrap(),
                "decode of {text:?}"
            );
        }
    }

    #[test]
    fn a_missing_tokenizer_is_an_error_naming_the_file() {
        let err = TextTokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("/nonexistent/tokenizer.json"), "{message}");
        assert!(message.contains("cannot read the tokenizer"), "{message}");
    }

    #[test]
    fn a_file_that_is_not_a_tokenizer_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, b"{\"not\": \"a tokenizer\"}").unwrap();
        let message = TextTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(message.contains(&*path.to_string_lossy()), "{message}");
        assert!(message.contains("not a tokenizer"), "{message}");
    }

    #[test]
    fn the_end_of_text_token_falls_back_to_the_eos_names() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["</s>", "<|end_of_text|>", "<eos>"] {
            let tokenizer = renamed_end_of_text(dir.path(), name);
            assert_eq!(tokenizer.end_of_text(), Some(0), "{name}");
        }
        assert_eq!(
            renamed_end_of_text(dir.path(), "<|unknown|>").end_of_text(),
            None
        );
    }
}
