//! Text data for the GPTs: token ids split into training and validation
//! parts, and windows drawn deterministically. The byte GPT's ids are the
//! bytes of a file; a pretrained model's come from its tokenizer, over text
//! documents packed with an end-of-text token after each, or from a
//! pre-tokenized file (nanoGPT's `.bin`).

use crate::trainer::{TextTokenizer, TrainError};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// Where the corpus comes from when `--data` is not given: the license
/// texts of Debian's `base-files` package, present on every Debian and
/// Ubuntu system (about 300 KB of English prose).
pub const DEFAULT_CORPUS_DIR: &str = "/usr/share/common-licenses";

/// Token ids of text, split into a training part and the last tenth for
/// validation. For the byte GPT the ids are the bytes (0..=255).
#[derive(Clone, Debug)]
pub struct TextData {
    /// The training ids.
    pub train: Vec<u32>,
    /// The validation ids (the end of the text).
    pub validation: Vec<u32>,
    /// Where the text came from, for messages.
    pub source: String,
}

/// One document: the UTF-8 text of one file.
#[derive(Clone, Debug)]
pub struct Document {
    /// The file, for messages.
    pub path: PathBuf,
    /// Its text.
    pub text: String,
}

impl Document {
    /// Reads `path` as UTF-8 text.
    pub fn read(path: &Path) -> Result<Self, TrainError> {
        let bytes = std::fs::read(path).map_err(|e| TrainError::Data {
            path: path.to_path_buf(),
            detail: format!("cannot read the text: {e}"),
        })?;
        let text = String::from_utf8(bytes).map_err(|e| TrainError::Data {
            path: path.to_path_buf(),
            detail: format!(
                "not UTF-8 text (byte {} is not valid UTF-8); a tokenizer reads UTF-8, so \
                 convert the file (iconv -t UTF-8) or leave it out",
                e.utf8_error().valid_up_to()
            ),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            text,
        })
    }

    /// The documents `--data PATH` names: a file is one document; a
    /// directory's regular files, in name order and each once (links to
    /// the same file count once), are one document each.
    pub fn read_all(path: &Path) -> Result<Vec<Self>, TrainError> {
        let metadata = std::fs::metadata(path).map_err(|e| TrainError::Data {
            path: path.to_path_buf(),
            detail: format!("cannot read the text: {e}"),
        })?;
        if !metadata.is_dir() {
            return Ok(vec![Self::read(path)?]);
        }
        let files = corpus_files(path).map_err(|e| TrainError::Data {
            path: path.to_path_buf(),
            detail: format!("cannot list the directory of text files: {e}"),
        })?;
        if files.is_empty() {
            return Err(TrainError::Data {
                path: path.to_path_buf(),
                detail: "the directory holds no files; give --data a directory of text files, \
                         a text file, or a .bin token file"
                    .into(),
            });
        }
        files.iter().map(|file| Self::read(file)).collect()
    }

    /// The files of [`DEFAULT_CORPUS_DIR`], one document each, in name
    /// order.
    pub fn default_corpus() -> Result<Vec<Self>, TrainError> {
        let files = default_corpus_files()?;
        files.iter().map(|file| Self::read(file)).collect()
    }
}

impl TextData {
    /// Splits `text` into training (first 90%) and validation (last 10%);
    /// each part must hold at least one window of `context + 1` bytes.
    pub fn from_bytes(text: Vec<u8>, context: usize, source: &str) -> Result<Self, TrainError> {
        let ids = text.into_iter().map(u32::from).collect();
        Self::split(ids, context, source, "bytes of text")
    }

    /// Reads a text file (UTF-8 or any bytes: the vocabulary is bytes).
    pub fn load(path: &Path, context: usize) -> Result<Self, TrainError> {
        let text = std::fs::read(path).map_err(|e| TrainError::Data {
            path: path.to_path_buf(),
            detail: format!("cannot read the text corpus: {e}"),
        })?;
        Self::from_bytes(text, context, &path.display().to_string())
    }

    /// The files of [`DEFAULT_CORPUS_DIR`], concatenated in name order (so
    /// every rank and every run reads the same text).
    pub fn default_corpus(context: usize) -> Result<Self, TrainError> {
        let mut text = Vec::new();
        for path in default_corpus_files()? {
            let bytes = std::fs::read(&path).map_err(|e| TrainError::Data {
                path: path.clone(),
                detail: format!("cannot read: {e}"),
            })?;
            text.extend_from_slice(&bytes);
        }
        if text.is_empty() {
            return Err(default_corpus_missing("holds no text"));
        }
        Self::from_bytes(text, context, DEFAULT_CORPUS_DIR)
    }

    /// The data for a model with `tokenizer`, from what `--data` names: a
    /// path ending in `.bin` is a token file ([`TextData::from_token_file`]),
    /// any other path a text file or a directory of them
    /// ([`Document::read_all`]), and without `--data` the default corpus,
    /// all tokenized with [`TextData::tokenized`].
    pub fn for_tokenizer(
        data: Option<&Path>,
        tokenizer: &TextTokenizer,
        context: usize,
    ) -> Result<Self, TrainError> {
        match data {
            Some(path) if path.extension().is_some_and(|e| e == "bin") => {
                Self::from_token_file(path, context, tokenizer.vocab_size())
            }
            Some(path) => Self::tokenized(
                &Document::read_all(path)?,
                tokenizer,
                context,
                &path.display().to_string(),
            ),
            None => Self::tokenized(
                &Document::default_corpus()?,
                tokenizer,
                context,
                DEFAULT_CORPUS_DIR,
            ),
        }
    }

    /// Encodes each document and packs them into one sequence with the
    /// tokenizer's end-of-text token after each (nanoGPT's way: windows
    /// cross document boundaries and the model learns where one ends),
    /// then splits it as [`TextData::from_bytes`] does. A tokenizer without
    /// an end-of-text token can only read a single document.
    pub fn tokenized(
        documents: &[Document],
        tokenizer: &TextTokenizer,
        context: usize,
        source: &str,
    ) -> Result<Self, TrainError> {
        let end_of_text = tokenizer.end_of_text();
        if end_of_text.is_none() && documents.len() > 1 {
            return Err(TrainError::Data {
                path: tokenizer.path().to_path_buf(),
                detail: format!(
                    "the tokenizer has no end-of-text token (<|endoftext|>, </s>, \
                     <|end_of_text|> or <eos>) to put between the {} documents of {source}; \
                     give --data a single text file",
                    documents.len()
                ),
            });
        }
        let encoded = documents
            .par_iter()
            .map(|document| {
                tokenizer
                    .encode(&document.text)
                    .map_err(|e| TrainError::Data {
                        path: document.path.clone(),
                        detail: format!("cannot tokenize: {e}"),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let total = encoded.iter().map(|ids| ids.len() + 1).sum();
        let mut ids = Vec::with_capacity(total);
        for document in encoded {
            ids.extend(document);
            ids.extend(end_of_text);
        }
        Self::split(ids, context, source, "tokens")
    }

    /// Reads a file of little-endian `u16` token ids (nanoGPT's `.bin`,
    /// as its `prepare.py` writes with `np.uint16`) and splits it as
    /// [`TextData::from_bytes`] does; every id must be below `vocab_size`.
    pub fn from_token_file(
        path: &Path,
        context: usize,
        vocab_size: usize,
    ) -> Result<Self, TrainError> {
        let data_error = |detail: String| TrainError::Data {
            path: path.to_path_buf(),
            detail,
        };
        if vocab_size > 1 << 16 {
            return Err(data_error(format!(
                "a .bin token file holds u16 ids, which cannot name all {vocab_size} tokens of \
                 this tokenizer; give --data the text instead"
            )));
        }
        let bytes = std::fs::read(path)
            .map_err(|e| data_error(format!("cannot read the token file: {e}")))?;
        if bytes.is_empty() {
            return Err(data_error(
                "the token file is empty; a .bin file holds little-endian u16 token ids \
                 (nanoGPT's train.bin)"
                    .into(),
            ));
        }
        if bytes.len() % 2 != 0 {
            return Err(data_error(format!(
                "{} bytes is an odd length for a file of u16 token ids; is it cut short, or \
                 not a token file? (only a path ending in .bin is read as tokens)",
                bytes.len()
            )));
        }
        let ids: Vec<u32> = bytes
            .chunks_exact(2)
            .map(|pair| u32::from(u16::from_le_bytes([pair[0], pair[1]])))
            .collect();
        if let Some((position, id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab_size)
        {
            return Err(data_error(format!(
                "token {position} (byte {}) is id {id}, not below the tokenizer's vocabulary \
                 size {vocab_size}; was the file made with this model's tokenizer?",
                2 * position
            )));
        }
        Self::split(ids, context, &path.display().to_string(), "tokens")
    }

    /// Splits `ids` into training (first 90%) and validation (last 10%);
    /// each part must hold at least one window of `context + 1` ids.
    /// `unit` names what the ids count, for the message.
    fn split(
        mut ids: Vec<u32>,
        context: usize,
        source: &str,
        unit: &str,
    ) -> Result<Self, TrainError> {
        let total = ids.len();
        let validation = ids.split_off(total - total / 10);
        // The training part is at least as long as the validation part, so
        // checking the validation part covers both.
        if validation.len() <= context {
            return Err(TrainError::Data {
                path: PathBuf::from(source),
                detail: format!(
                    "{total} {unit} leave {} for validation, fewer than one window of \
                     --context {context} + 1; give more text or a shorter --context",
                    validation.len()
                ),
            });
        }
        Ok(Self {
            train: ids,
            validation,
            source: source.to_string(),
        })
    }

    /// Windows of `context + 1` ids (inputs and next-token targets) that
    /// rank `rank` trains on in the global micro-batch starting at sequence
    /// `first_sequence`: sequence `k = first_sequence + rank * batch + i`
    /// starts at a position drawn from `(seed, k)` alone, so the global
    /// batch is the same whatever the world size, and a resume continues
    /// from a sequence count. Row-major `[batch, context + 1]`.
    pub fn windows_at(
        &self,
        first_sequence: u64,
        rank: usize,
        batch: usize,
        context: usize,
        seed: u64,
    ) -> Vec<u32> {
        let starts = (self.train.len() - context) as u64;
        let first = first_sequence + (rank * batch) as u64;
        let mut ids = Vec::with_capacity(batch * (context + 1));
        for i in 0..batch as u64 {
            let start = (mix(seed, first + i) % starts) as usize;
            ids.extend_from_slice(&self.train[start..start + context + 1]);
        }
        ids
    }

    /// The `i`-th of `count` validation windows of `context + 1` ids,
    /// evenly spaced over the validation part (the same on every rank).
    pub fn validation_window(&self, i: usize, count: usize, context: usize) -> Vec<u32> {
        let starts = self.validation.len() - context;
        let start = i * starts / count.max(1);
        self.validation[start..start + context + 1].to_vec()
    }
}

/// The regular files of `dir` in name order, each once: several names may
/// be links to the same file (GPL -> GPL-3), so each canonical path is
/// kept the first time it appears. Entries that cannot be resolved
/// (dangling links) are skipped.
fn corpus_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .collect();
    paths.sort();
    let mut seen = std::collections::BTreeSet::new();
    let mut files = Vec::new();
    for path in paths {
        let Ok(real) = std::fs::canonicalize(&path) else {
            continue;
        };
        if real.is_file() && seen.insert(real.clone()) {
            files.push(real);
        }
    }
    Ok(files)
}

/// [`corpus_files`] of [`DEFAULT_CORPUS_DIR`].
fn default_corpus_files() -> Result<Vec<PathBuf>, TrainError> {
    let files = corpus_files(Path::new(DEFAULT_CORPUS_DIR))
        .map_err(|e| default_corpus_missing(&format!("cannot list: {e}")))?;
    if files.is_empty() {
        return Err(default_corpus_missing("holds no files"));
    }
    Ok(files)
}

/// What to pass instead when [`DEFAULT_CORPUS_DIR`] cannot be read.
fn default_corpus_missing(detail: &str) -> TrainError {
    TrainError::Data {
        path: PathBuf::from(DEFAULT_CORPUS_DIR),
        detail: format!(
            "{detail}; without --data the GPT trains on the license texts Debian's \
             base-files installs there. Pass --data FILE with any plain text file"
        ),
    }
}

/// SplitMix64 of `(seed, index)`: a well-mixed position for each sequence,
/// independent of how sequences are split among ranks.
fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(index)
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::tokenizer::fixture;

    #[test]
    fn the_global_batch_does_not_depend_on_the_world_size() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let data = TextData::from_bytes(text, 8, "test").unwrap();
        let whole = data.windows_at(40, 0, 8, 8, 7);
        let parts: Vec<u32> = (0..4)
            .flat_map(|rank| data.windows_at(40, rank, 2, 8, 7))
            .collect();
        assert_eq!(whole, parts);
    }

    #[test]
    fn too_little_text_is_an_error_that_says_what_to_do() {
        let err = TextData::from_bytes(vec![b'a'; 50], 16, "tiny.txt").unwrap_err();
        assert!(err.to_string().contains("--context"), "{err}");
    }

    /// Windows of the byte GPT as the `Vec<u8>` version of `TextData` drew
    /// them (printed by it before the ids became `u32`): the token-id
    /// generalization must not move a single byte.
    #[test]
    fn byte_windows_are_the_ones_drawn_before_ids_were_tokens() {
        let text = b"The quick brown fox jumps over the lazy dog. ".repeat(10);
        let data = TextData::from_bytes(text, 8, "fox").unwrap();
        let as_text = |ids: Vec<u32>| String::from_utf8(ids.iter().map(|&i| i as u8).collect());
        assert_eq!(
            as_text(data.windows_at(5, 1, 3, 8, 42)).unwrap(),
            " jumps ovuick browazy dog. "
        );
        let validation: Vec<String> = (0..3)
            .map(|i| as_text(data.validation_window(i, 3, 8)).unwrap())
            .collect();
        assert_eq!(validation, ["The quick", "own fox j", "s over th"]);
    }

    #[test]
    fn bytes_are_their_own_ids() {
        let data = TextData::from_bytes((0..=255u8).collect(), 8, "all bytes").unwrap();
        assert_eq!(all_ids(&data), (0..=255u32).collect::<Vec<_>>());
        assert_eq!(data.validation.len(), 25);
    }

    /// All the ids, training then validation.
    fn all_ids(data: &TextData) -> Vec<u32> {
        data.train.iter().chain(&data.validation).copied().collect()
    }

    fn document(name: &str, text: &str) -> Document {
        Document {
            path: PathBuf::from(name),
            text: text.to_string(),
        }
    }

    /// Writes `ids` as nanoGPT does (`np.array(ids, dtype=np.uint16).tofile`).
    fn write_token_file(path: &Path, ids: &[u32]) {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| u16::try_from(id).unwrap().to_le_bytes())
            .collect();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn documents_are_packed_with_one_end_of_text_after_each() {
        let tokenizer = fixture::tiny();
        let documents = [
            document("one.txt", "This is the end of one document."),
            document("two.txt", "This is the start of another."),
        ];
        let data = TextData::tokenized(&documents, &tokenizer, 2, "two").unwrap();
        // tokens.json's fourth case is the two joined by <|endoftext|>, as
        // transformers encodes it; packing adds the one after the last.
        let json = std::fs::read(fixture::path("tokens.json")).unwrap();
        let golden: serde_json::Value = serde_json::from_slice(&json).unwrap();
        let case = &golden["cases"][3];
        assert_eq!(
            case["text"],
            "This is the end of one document.<|endoftext|>This is the start of another."
        );
        let mut expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        expected.push(0);
        assert_eq!(all_ids(&data), expected);
        assert_eq!(expected.iter().filter(|&&id| id == 0).count(), 2);
    }

    #[test]
    fn the_split_keeps_the_last_tenth_of_the_tokens_for_validation() {
        let tokenizer = fixture::tiny();
        let text = "The GNU General Public License is a free, copyleft license. ".repeat(4);
        let data =
            TextData::tokenized(&[document("gpl.txt", &text)], &tokenizer, 4, "gpl").unwrap();
        let mut packed = tokenizer.encode(&text).unwrap();
        packed.push(0);
        let total = packed.len();
        assert!(total >= 50, "{total} tokens");
        assert_eq!(data.validation.len(), total / 10);
        assert_eq!(data.train[..], packed[..total - total / 10]);
        assert_eq!(data.validation[..], packed[total - total / 10..]);
        assert_eq!(data.source, "gpl");
    }

    #[test]
    fn too_few_tokens_is_an_error_in_tokens_naming_the_context() {
        let tokenizer = fixture::tiny();
        let message = TextData::tokenized(&[document("a.txt", "a short text")], &tokenizer, 8, "a")
            .unwrap_err()
            .to_string();
        assert!(message.contains("tokens leave"), "{message}");
        assert!(message.contains("--context 8"), "{message}");
    }

    #[test]
    fn a_directory_is_one_document_per_file_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = ("The first license text.", "A second, shorter one.");
        std::fs::write(dir.path().join("b.txt"), b).unwrap();
        std::fs::write(dir.path().join("a.txt"), a).unwrap();
        // A second name for a.txt and a subdirectory: neither is read.
        std::os::unix::fs::symlink(dir.path().join("a.txt"), dir.path().join("c.txt")).unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/e.txt"), "not read").unwrap();

        let documents = Document::read_all(dir.path()).unwrap();
        let texts: Vec<&str> = documents.iter().map(|d| d.text.as_str()).collect();
        assert_eq!(texts, [a, b]);

        let tokenizer = fixture::tiny();
        let data = TextData::for_tokenizer(Some(dir.path()), &tokenizer, 2).unwrap();
        let mut expected = tokenizer.encode(a).unwrap();
        expected.push(0);
        expected.extend(tokenizer.encode(b).unwrap());
        expected.push(0);
        assert_eq!(all_ids(&data), expected);
    }

    #[test]
    fn a_file_is_one_document() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("corpus.txt");
        let text = "One file, one document.<|endoftext|>Its own end-of-text is kept.";
        std::fs::write(&path, text).unwrap();
        let tokenizer = fixture::tiny();
        let data = TextData::for_tokenizer(Some(&path), &tokenizer, 2).unwrap();
        let mut expected = tokenizer.encode(text).unwrap();
        expected.push(0);
        assert_eq!(all_ids(&data), expected);
        assert_eq!(data.source, path.display().to_string());
    }

    #[test]
    fn a_text_file_that_is_not_utf8_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latin1.txt");
        std::fs::write(&path, b"caf\xe9 au lait").unwrap();
        let message = TextData::for_tokenizer(Some(&path), &fixture::tiny(), 2)
            .unwrap_err()
            .to_string();
        assert!(message.contains(&*path.to_string_lossy()), "{message}");
        assert!(message.contains("not UTF-8"), "{message}");
        assert!(message.contains("byte 3"), "{message}");
    }

    #[test]
    fn several_documents_need_an_end_of_text_token() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = fixture::renamed_end_of_text(dir.path(), "<|unknown|>");
        let text = "Without an end-of-text token one document still works. ".repeat(3);
        let one = TextData::tokenized(&[document("a.txt", &text)], &tokenizer, 4, "one").unwrap();
        assert_eq!(all_ids(&one), tokenizer.encode(&text).unwrap());

        let two = [document("a.txt", &text), document("b.txt", &text)];
        let message = TextData::tokenized(&two, &tokenizer, 4, "two")
            .unwrap_err()
            .to_string();
        assert!(message.contains("no end-of-text token"), "{message}");
        assert!(message.contains("2 documents of two"), "{message}");
    }

    #[test]
    fn a_token_file_reads_back_the_ids_and_windows_written() {
        let tokenizer = fixture::tiny();
        let text = "The GNU General Public License is a free, copyleft license. ".repeat(5);
        let tokenized =
            TextData::tokenized(&[document("gpl.txt", &text)], &tokenizer, 8, "gpl").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        write_token_file(&path, &all_ids(&tokenized));

        let read = TextData::for_tokenizer(Some(&path), &tokenizer, 8).unwrap();
        assert_eq!(read.train, tokenized.train);
        assert_eq!(read.validation, tokenized.validation);
        assert_eq!(
            read.windows_at(3, 1, 4, 8, 11),
            tokenized.windows_at(3, 1, 4, 8, 11)
        );
        assert_eq!(
            read.validation_window(1, 2, 8),
            tokenized.validation_window(1, 2, 8)
        );
    }

    #[test]
    fn token_file_errors_name_the_file_and_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        let message = |bytes: &[u8], vocab_size: usize| {
            std::fs::write(&path, bytes).unwrap();
            let err = TextData::from_token_file(&path, 2, vocab_size).unwrap_err();
            let message = err.to_string();
            assert!(message.contains(&*path.to_string_lossy()), "{message}");
            message
        };
        assert!(message(b"", 384).contains("empty"));
        let odd = message(&[1, 0, 2, 0, 3], 384);
        assert!(odd.contains("5 bytes is an odd length"), "{odd}");

        let mut ids: Vec<u32> = (0..40).collect();
        ids[17] = 384;
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| (id as u16).to_le_bytes())
            .collect();
        let too_big = message(&bytes, 384);
        assert!(
            too_big.contains("token 17 (byte 34) is id 384"),
            "{too_big}"
        );
        assert!(too_big.contains("vocabulary size 384"), "{too_big}");

        let wide = message(&bytes, 100_000);
        assert!(wide.contains("cannot name all 100000 tokens"), "{wide}");

        let missing = TextData::from_token_file(&dir.path().join("none.bin"), 2, 384)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("none.bin: cannot read"), "{missing}");
    }

    #[test]
    fn only_a_path_ending_in_bin_is_a_token_file() {
        // The same bytes as text: "ABCD..." read as a document, not as
        // the u16 ids 0x4241, ... (which the vocabulary check would refuse).
        let dir = tempfile::tempdir().unwrap();
        let text: String = ('A'..='Z').cycle().take(60).collect();
        let path = dir.path().join("letters.txt");
        std::fs::write(&path, &text).unwrap();
        let tokenizer = fixture::tiny();
        let data = TextData::for_tokenizer(Some(&path), &tokenizer, 2).unwrap();
        let mut expected = tokenizer.encode(&text).unwrap();
        expected.push(0);
        assert_eq!(all_ids(&data), expected);

        let bin = dir.path().join("letters.bin");
        std::fs::write(&bin, &text).unwrap();
        let message = TextData::for_tokenizer(Some(&bin), &tokenizer, 2)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("token 0 (byte 0) is id 16961"),
            "{message}"
        );
    }

    /// `golden.safetensors` holds two windows of the default corpus as
    /// `make_fixtures.py` tokenized it with `transformers` (its files in
    /// name order, each real file once, joined by `<|endoftext|>`), at
    /// tokens 1000 and 5000: both inside the first file (Apache-2.0), so
    /// this checks a long real text's ids and that the corpus starts where
    /// the script's did. It assumes the license texts of the Debian
    /// base-files the fixture was made with.
    #[test]
    fn the_default_corpus_is_packed_as_the_fixture_script_read_it() {
        let tokenizer = fixture::tiny();
        let data = TextData::for_tokenizer(None, &tokenizer, 16).unwrap();
        assert_eq!(data.source, DEFAULT_CORPUS_DIR);
        let golden = candle_core::safetensors::load(
            fixture::path("golden.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let windows = golden["input_ids"].to_vec2::<i64>().unwrap();
        for (start, window) in [1000, 5000].into_iter().zip(windows) {
            let ids: Vec<i64> = data.train[start..start + window.len()]
                .iter()
                .map(|&id| i64::from(id))
                .collect();
            assert_eq!(ids, window, "window at token {start}");
        }
    }
}
