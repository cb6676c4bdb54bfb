//! Property-based fuzzing on stable Rust: mutated GGUF files through the whole loader, and
//! arbitrary text through the tokenizer. Each input must be refused with an error or served;
//! none may panic. proptest shrinks a failing input to a small one and records its seed in
//! `proptest-regressions/` (kept in the repo, replayed first on every run).

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};

use crate::gguf::{GgufFile, Value};
use crate::model::Model;
use crate::testing::{TinyArch, TinyModel, tiny_model};
use crate::{Engine, EngineConfig, GenerateParams, generate};

/// The seed input: the tiny model's GGUF (metadata, a real vocabulary and merges, tensors).
fn seed() -> &'static [u8] {
    static S: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    S.get_or_init(|| TinyModel::default().gguf())
}

/// Values that break length and count fields: zero, one, the edges of 32 and 64 bits, and
/// sizes just past what any allocation can hold.
const INTERESTING: [u64; 8] =
    [0, 1, 0x7fff_ffff, 0xffff_ffff, 1 << 32, 1 << 40, u64::MAX >> 1, u64::MAX];

#[derive(Debug, Clone)]
enum Mutation {
    /// One byte anywhere.
    Byte(prop::sample::Index, u8),
    /// Eight bytes of the header region (counts, lengths, types, offsets) set to a value that
    /// breaks them.
    Word(prop::sample::Index, prop::sample::Index),
    /// The file cut short.
    Truncate(prop::sample::Index),
}

/// Bytes at the start of the file where the counts, key lengths, value types and the first
/// tensor infos lie.
const HEADER: usize = 4096;

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Byte(i, b)),
        4 => (any::<prop::sample::Index>(), any::<prop::sample::Index>())
            .prop_map(|(i, v)| Mutation::Word(i, v)),
        1 => any::<prop::sample::Index>().prop_map(Mutation::Truncate),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    match m {
        // A file already cut to nothing has no byte left to damage.
        Mutation::Byte(_, _) if bytes.is_empty() => {}
        Mutation::Byte(i, b) => {
            let at = i.index(bytes.len());
            bytes[at] = *b;
        }
        Mutation::Word(i, v) => {
            let at = i.index(HEADER.min(bytes.len()).saturating_sub(8).max(1));
            let w = INTERESTING[v.index(INTERESTING.len())].to_le_bytes();
            let end = (at + 8).min(bytes.len());
            bytes[at..end].copy_from_slice(&w[..end - at]);
        }
        Mutation::Truncate(i) => bytes.truncate(i.index(bytes.len())),
    }
}

/// `cases` per property, unless PDMESH_FUZZ_CASES says otherwise (`just fuzz` runs longer).
fn config(cases: u32) -> Config {
    let cases =
        std::env::var("PDMESH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(config(600))]

    /// A damaged model file is refused at load or loads and tokenizes; it never panics and
    /// never asks for memory it cannot have (a count of 2^63 must not become an allocation).
    #[test]
    fn a_damaged_gguf_is_refused_or_served_never_a_panic(muts in prop::collection::vec(mutation(), 1..5)) {
        let mut b = seed().to_vec();
        for m in &muts {
            apply(&mut b, m);
        }
        if let Ok(g) = GgufFile::from_bytes(b)
            && let Ok(model) = Model::from_gguf(g, "fuzz.gguf".into())
        {
            let ids = model.tokenizer.encode("the one and the two").unwrap_or_default();
            let _ = model.tokenizer.decode(&ids);
        }
    }
}

/// Metadata keys a model's shape, rope, vocabulary and specials come from (`{a}` is the
/// architecture).
const KEYS: [&str; 22] = [
    "{a}.block_count",
    "{a}.context_length",
    "{a}.embedding_length",
    "{a}.feed_forward_length",
    "{a}.attention.head_count",
    "{a}.attention.head_count_kv",
    "{a}.attention.layer_norm_rms_epsilon",
    "{a}.attention.key_length",
    "{a}.attention.value_length",
    "{a}.attention.sliding_window",
    "{a}.attention.sliding_window_pattern",
    "{a}.rope.freq_base",
    "{a}.rope.freq_base_swa",
    "{a}.rope.dimension_count",
    "{a}.rope.scaling.type",
    "{a}.rope.scaling.factor",
    "{a}.vocab_size",
    "general.architecture",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
];

/// Mostly values of the type a key expects (so that range checks, not type checks, are what
/// is exercised), some of the wrong type.
fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => prop::sample::select(vec![0u32, 1, 2, 3, 5, 7, 16, 31, 64, 4096, 1 << 20, u32::MAX])
            .prop_map(Value::U32),
        3 => prop::sample::select(vec![0.0f32, -1.0, 1e-30, 0.5, 1e30, f32::NAN, f32::INFINITY])
            .prop_map(Value::F32),
        2 => prop::sample::select(vec!["", "llama", "qwen3", "linear", "yarn", "bert", "gpt2", "llama3"])
            .prop_map(|s| Value::String(s.into())),
        1 => prop::sample::select(vec![0u64, 1 << 33, u64::MAX]).prop_map(Value::U64),
        1 => prop::sample::select(vec![-1i32, i32::MIN]).prop_map(Value::I32),
        1 => Just(Value::Bool(true)),
        1 => Just(Value::Array(Vec::new())),
    ]
}

proptest! {
    #![proptest_config(config(400))]

    /// A metadata value set to nonsense (a wrong type, zero, 2^32 - 1, NaN, another name) is
    /// refused at load naming the key, or the model it makes runs: loads never panic, and
    /// a model that loads generates without panicking.
    #[test]
    fn nonsense_metadata_is_refused_or_runs(
        arch in prop::sample::select(vec![
            TinyArch::Llama, TinyArch::Llama3, TinyArch::Qwen2, TinyArch::Qwen3, TinyArch::Gemma3,
        ]),
        edits in prop::collection::vec((prop::sample::select(KEYS.to_vec()), value()), 1..3),
    ) {
        let tiny = TinyModel { arch, ..Default::default() };
        let mut b = tiny.builder();
        for (k, v) in edits {
            b = b.set_kv(&k.replace("{a}", arch.name()), v);
        }
        let Ok(g) = GgufFile::from_bytes(b.build()) else { return Ok(()) };
        let Ok(model) = Model::from_gguf(g, "fuzz.gguf".into()) else { return Ok(()) };
        let cfg = EngineConfig { threads: 1, kv_blocks: 16, ..Default::default() };
        let Ok(mut e) = Engine::new(std::sync::Arc::new(model), cfg) else { return Ok(()) };
        let p = GenerateParams { max_tokens: 3, ignore_eos: true, ..Default::default() };
        let _ = generate(&mut e, &[1, 2, 3], &p, |_| true);
    }
}

proptest! {
    #![proptest_config(config(2000))]

    /// Any text encodes, and decodes back to itself (a byte-level vocabulary loses nothing).
    #[test]
    fn any_text_round_trips_through_the_tokenizer(s in any::<String>()) {
        let t = &tiny_model().tokenizer;
        let ids = t.encode(&s).expect("every text encodes");
        prop_assert_eq!(t.decode(&ids), s);
    }
}
