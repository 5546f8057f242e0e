//! The names a family gives its layers where they differ from Llama's.

/// The names of a block's norms where it normalizes the attention's and
/// the MLP's outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormNames {
    /// Gemma 2's (and OLMo 2's): `post_attention_layernorm` after the
    /// attention, `pre_feedforward_layernorm` before the MLP,
    /// `post_feedforward_layernorm` after it.
    #[default]
    Gemma,
    /// GLM-4's: `post_self_attn_layernorm` after the attention,
    /// `post_attention_layernorm` before the MLP (Llama's name),
    /// `post_mlp_layernorm` after it.
    Glm4,
    /// HyperCLOVA X's: `post_norm1` after the attention,
    /// `post_attention_layernorm` before the MLP (Llama's name), `post_norm2`
    /// after it.
    HyperClovaX,
}

impl NormNames {
    /// The norm of the attention's output.
    pub(crate) fn attention_output(self) -> &'static str {
        match self {
            Self::Gemma => "post_attention_layernorm",
            Self::Glm4 => "post_self_attn_layernorm",
            Self::HyperClovaX => "post_norm1",
        }
    }

    /// The norm of the MLP's input, in blocks that also normalize outputs.
    pub(crate) fn mlp_input(self) -> &'static str {
        match self {
            Self::Gemma => "pre_feedforward_layernorm",
            Self::Glm4 | Self::HyperClovaX => "post_attention_layernorm",
        }
    }

    /// The norm of the MLP's output.
    pub(crate) fn mlp_output(self) -> &'static str {
        match self {
            Self::Gemma => "post_feedforward_layernorm",
            Self::Glm4 => "post_mlp_layernorm",
            Self::HyperClovaX => "post_norm2",
        }
    }
}

/// The names of an MLP without a gate, `down(act(up(x)))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UngatedMlp {
    /// Starcoder2's: `mlp.c_fc` (up), `mlp.c_proj` (down).
    CFc,
    /// Phi's: `mlp.fc1` (up), `mlp.fc2` (down).
    Fc,
    /// GPT-J's: `mlp.fc_in`, `mlp.fc_out`.
    FcInOut,
    /// Nemotron's and Arcee's: `mlp.up_proj`, `mlp.down_proj`.
    UpDown,
    /// GPT-NeoX's: `mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`.
    NeoX,
}

impl UngatedMlp {
    /// The up and the down projection's names under `mlp`.
    pub(crate) fn names(self) -> [&'static str; 2] {
        match self {
            Self::CFc => ["c_fc", "c_proj"],
            Self::Fc => ["fc1", "fc2"],
            Self::FcInOut => ["fc_in", "fc_out"],
            Self::UpDown => ["up_proj", "down_proj"],
            Self::NeoX => ["dense_h_to_4h", "dense_4h_to_h"],
        }
    }
}

/// The names of the layers a family names its own way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LayerNames {
    /// Llama's: `self_attn.o_proj`, `self_attn.q_norm` and `k_norm`,
    /// `model.norm`.
    #[default]
    Llama,
    /// Phi's: `self_attn.dense`, `self_attn.q_layernorm` and
    /// `k_layernorm`, `model.final_layernorm`.
    Phi,
    /// GPT-NeoX's: `gpt_neox.embed_in`, `gpt_neox.layers.{i}.attention`
    /// with `query_key_value` and `dense`, `gpt_neox.final_layer_norm`,
    /// `embed_out`.
    NeoX,
    /// StableLM's: Llama's, but for the norms of each query and key head,
    /// `self_attn.q_layernorm.norms.{h}` and `k_layernorm.norms.{h}`, a
    /// tensor per head.
    StableLm,
    /// Hunyuan's: Llama's, but for the query and key norms,
    /// `self_attn.query_layernorm` and `key_layernorm`.
    Hunyuan,
    /// GPT-J's: `transformer.wte`, `transformer.h.{i}` with `ln_1` and
    /// `attn.{q,k,v,out}_proj`, `transformer.ln_f`, `lm_head`.
    GptJ,
    /// Falcon's: `transformer.word_embeddings`, `transformer.h.{i}` with
    /// `self_attention.query_key_value` and `dense` (and `ln_attn`, `ln_mlp`
    /// where each branch has its norm), `transformer.ln_f`, `lm_head`.
    Falcon,
    /// Sarvam MoE's: `model.word_embeddings`, `model.layers.{i}.attention`
    /// with `query_key_value`, `dense`, `query_layernorm` and
    /// `key_layernorm`.
    Sarvam,
    /// EXAONE 3's: `transformer.wte`, `transformer.h.{i}` with `ln_1`,
    /// `attn.attention.{q,k,v,out}_proj`, `ln_2` and `mlp.c_fc_0` (gate),
    /// `c_fc_1` (up), `c_proj` (down), `transformer.ln_f`, `lm_head`.
    Exaone,
    /// VaultGemma's: Llama's, but for the norm before the MLP,
    /// `pre_feedforward_layernorm` (Gemma 2's name; its blocks have no
    /// norms of the outputs).
    VaultGemma,
    /// Apertus's: Llama's, but for the block's norms, `attention_layernorm`
    /// and `feedforward_layernorm`.
    Apertus,
}

impl LayerNames {
    /// What the model's tensors but the head's sit under.
    pub(crate) fn model(self) -> &'static str {
        match self {
            Self::Llama
            | Self::Phi
            | Self::StableLm
            | Self::Hunyuan
            | Self::Sarvam
            | Self::VaultGemma
            | Self::Apertus => "model",
            Self::NeoX => "gpt_neox",
            Self::GptJ | Self::Falcon | Self::Exaone => "transformer",
        }
    }

    /// The token embedding, under [`LayerNames::model`].
    pub(crate) fn embedding(self) -> &'static str {
        match self {
            Self::Llama
            | Self::Phi
            | Self::StableLm
            | Self::Hunyuan
            | Self::VaultGemma
            | Self::Apertus => "embed_tokens",
            Self::GptJ | Self::Exaone => "wte",
            Self::Falcon | Self::Sarvam => "word_embeddings",
            Self::NeoX => "embed_in",
        }
    }

    /// A block's attention, under its layer.
    pub(crate) fn attention(self) -> &'static str {
        match self {
            Self::Llama
            | Self::Phi
            | Self::StableLm
            | Self::Hunyuan
            | Self::VaultGemma
            | Self::Apertus => "self_attn",
            Self::GptJ => "attn",
            Self::Exaone => "attn.attention",
            Self::Falcon => "self_attention",
            Self::NeoX | Self::Sarvam => "attention",
        }
    }

    /// Layer `layer`'s attention, in full (`model.layers.{layer}.self_attn`).
    pub(crate) fn attention_at(self, layer: usize) -> String {
        format!(
            "{}.{}.{layer}.{}",
            self.model(),
            self.layers(),
            self.attention()
        )
    }

    /// The blocks, under [`LayerNames::model`] (`{layers}.{i}`).
    pub(crate) fn layers(self) -> &'static str {
        match self {
            Self::GptJ | Self::Falcon | Self::Exaone => "h",
            _ => "layers",
        }
    }

    /// A block's input norm, under its layer.
    pub(crate) fn input_norm(self) -> &'static str {
        match self {
            Self::GptJ | Self::Exaone => "ln_1",
            Self::Apertus => "attention_layernorm",
            _ => "input_layernorm",
        }
    }

    /// A pre-norm block's norm before its MLP, under its layer.
    pub(crate) fn mlp_norm(self) -> &'static str {
        match self {
            Self::Exaone => "ln_2",
            Self::VaultGemma => "pre_feedforward_layernorm",
            Self::Apertus => "feedforward_layernorm",
            _ => "post_attention_layernorm",
        }
    }

    /// A gated MLP's gate, up and down projections, under its `mlp`.
    pub(crate) fn gated_mlp(self) -> [&'static str; 3] {
        match self {
            Self::Exaone => ["c_fc_0", "c_fc_1", "c_proj"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        }
    }

    /// The norms of a parallel block whose branches each have one (GPT-NeoX's
    /// and Falcon's), under its layer: the attention's, the MLP's.
    pub(crate) fn branch_norms(self) -> [&'static str; 2] {
        match self {
            Self::Falcon => ["ln_attn", "ln_mlp"],
            _ => ["input_layernorm", "post_attention_layernorm"],
        }
    }

    /// The query, key and value projections in one, under the attention.
    pub(crate) fn fused_qkv(self) -> &'static str {
        match self {
            Self::Llama
            | Self::Phi
            | Self::StableLm
            | Self::Hunyuan
            | Self::GptJ
            | Self::Exaone
            | Self::VaultGemma
            | Self::Apertus => "qkv_proj",
            Self::NeoX | Self::Falcon | Self::Sarvam => "query_key_value",
        }
    }

    /// The attention's output projection, under the attention.
    pub(crate) fn output_projection(self) -> &'static str {
        match self {
            Self::Llama | Self::StableLm | Self::Hunyuan | Self::VaultGemma | Self::Apertus => {
                "o_proj"
            }
            Self::Phi | Self::NeoX | Self::Falcon | Self::Sarvam => "dense",
            Self::GptJ | Self::Exaone => "out_proj",
        }
    }

    /// The query and the key norm, under the attention.
    pub(crate) fn qk_norms(self) -> [&'static str; 2] {
        match self {
            Self::Llama
            | Self::NeoX
            | Self::GptJ
            | Self::Falcon
            | Self::Exaone
            | Self::VaultGemma
            | Self::Apertus => ["q_norm", "k_norm"],
            Self::Phi | Self::StableLm => ["q_layernorm", "k_layernorm"],
            Self::Hunyuan | Self::Sarvam => ["query_layernorm", "key_layernorm"],
        }
    }

    /// The norms of each query and key head hold a tensor per head
    /// (`norms.{h}.weight`) rather than one `[heads, head_dim]` weight.
    pub(crate) fn head_norm_per_head(self) -> bool {
        self == Self::StableLm
    }

    /// The norm after the last block, under [`LayerNames::model`].
    pub(crate) fn final_norm(self) -> &'static str {
        match self {
            Self::Llama
            | Self::StableLm
            | Self::Hunyuan
            | Self::Sarvam
            | Self::VaultGemma
            | Self::Apertus => "norm",
            Self::Phi => "final_layernorm",
            Self::NeoX => "final_layer_norm",
            Self::GptJ | Self::Falcon | Self::Exaone => "ln_f",
        }
    }

    /// The untied head.
    pub(crate) fn head(self) -> &'static str {
        match self {
            Self::Llama
            | Self::Phi
            | Self::StableLm
            | Self::Hunyuan
            | Self::GptJ
            | Self::Falcon
            | Self::Exaone
            | Self::Sarvam
            | Self::VaultGemma
            | Self::Apertus => "lm_head",
            Self::NeoX => "embed_out",
        }
    }
}
