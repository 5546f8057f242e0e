//! `--hf DIR`: a Hugging Face GPT-2 or Llama to fine-tune, its text
//! tokenized with its own tokenizer.

use super::{Args, TextData, TextTokenizer, TrainError};
use std::path::Path;
use std::sync::Arc;
use zero_candle::hub::{HubDir, HubSource};
use zero_candle::models::HubConfig;
use zero_candle::ShardedVarMap;

/// A hub model with the text it trains on.
#[derive(Clone, Debug)]
pub struct HubText {
    /// The model's directory, opened (its weights memory-mapped once, for
    /// every rank and for `--save-hf`).
    pub hub: Arc<HubDir>,
    /// Its `config.json`.
    pub config: HubConfig,
    /// Its `tokenizer.json`.
    pub tokenizer: TextTokenizer,
    /// `--data` (or the default corpus) tokenized with it.
    pub text: TextData,
}

impl HubText {
    /// Reads the config and the tokenizer of `--hf`'s directory and
    /// tokenizes the text; an error names the file or the config key that
    /// is unusable, or the flag to change.
    pub fn load(args: &Args, dir: &Path) -> Result<Self, TrainError> {
        let hub = Arc::new(HubDir::open(dir)?);
        let config = HubConfig::from_hub(&hub)?;
        let context = args.context as usize;
        let (positions, key) = config.max_positions();
        if context > positions {
            return Err(TrainError::Usage(format!(
                "--context {context} is longer than the model's {key} {positions} ({}); give \
                 --context {positions} or less",
                dir.display(),
            )));
        }
        if config.asks_for_dropout() && !args.quiet {
            eprintln!(
                "note: {} asks for dropout (or router jitter); fine-tuning here applies none",
                dir.join(zero_candle::hub::CONFIG_FILE).display()
            );
        }
        let tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json"))?;
        if tokenizer.vocab_size() > config.vocab_size() {
            return Err(TrainError::Data {
                path: tokenizer.path().to_path_buf(),
                detail: format!(
                    "has {} tokens, more than the model's vocab_size {}; is it this model's \
                     tokenizer?",
                    tokenizer.vocab_size(),
                    config.vocab_size()
                ),
            });
        }
        let text = TextData::for_tokenizer(args.data.as_deref(), &tokenizer, context)?;
        Ok(Self {
            hub,
            config,
            tokenizer,
            text,
        })
    }

    /// The variables, read from the directory's weights (memory-mapped; at
    /// stage 3 each rank reads its shard of the large ones).
    pub fn vars(&self) -> ShardedVarMap {
        let source = HubSource::new(self.hub.clone(), self.config.hub_layout());
        ShardedVarMap::new(source)
    }
}
