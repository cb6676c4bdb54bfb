//! Token ids against llama.cpp's on vocabulary fixtures: a SentencePiece vocabulary (as Llama 2
//! and Mistral 7B GGUFs have) and SmolLM2's byte-level BPE vocabulary under each supported
//! `tokenizer.ggml.pre`, with the ids llama.cpp (llama-cpp-python 0.3.36) gives for
//! `tests/data/multilingual.txt`, each of its lines and edge strings, the piece of every token
//! and the end-of-generation set. `just vocab-fixtures` (scripts/make_vocab_fixtures.py) writes
//! them to models/test/; without them these tests fail and say so.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

use std::path::PathBuf;
use std::sync::OnceLock;

use pdmesh_engine::Tokenizer;
use pdmesh_engine::gguf::GgufFile;
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixtures {
    text_file: String,
    vocabs: Vec<Vocab>,
}

#[derive(Deserialize)]
struct Vocab {
    name: String,
    file: String,
    eog: Vec<u32>,
    cases: Vec<Case>,
    /// Hex of each token's piece, where recorded.
    pieces: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn dir() -> PathBuf {
    root().join("models/test")
}

const MAKE: &str = "run `just vocab-fixtures` (scripts/make_vocab_fixtures.py with the bench venv)";

fn fixtures() -> &'static Fixtures {
    static F: OnceLock<Fixtures> = OnceLock::new();
    F.get_or_init(|| {
        let path = dir().join("vocab_fixtures.json");
        let json = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!("{}: {e}: the vocabulary fixtures are missing; {MAKE}", path.display())
        });
        let f: Fixtures = serde_json::from_str(&json).expect("the fixture file parses");
        let text = std::fs::read_to_string(root().join(&f.text_file)).expect("the test text reads");
        let recorded = f.vocabs.first().and_then(|v| v.cases.first()).map(|c| c.text.as_str());
        assert_eq!(
            recorded,
            Some(text.as_str()),
            "{} changed since the fixtures were made; {MAKE}",
            f.text_file
        );
        f
    })
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Loads the named fixture vocabulary and checks every recorded case, piece and the EOG set.
fn check(name: &str) {
    let f = fixtures();
    let v = f
        .vocabs
        .iter()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no fixture {name:?} in vocab_fixtures.json; {MAKE}"));
    let path = dir().join(&v.file);
    assert!(path.exists(), "{} is missing; {MAKE}", path.display());
    let gguf = GgufFile::open(&path).unwrap();
    let t = Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));

    let mut wrong = Vec::new();
    let mut tokens = 0;
    for c in &v.cases {
        let got = t.encode(&c.text).unwrap();
        tokens += c.ids.len();
        if got != c.ids {
            let at = got.iter().zip(&c.ids).take_while(|(a, b)| a == b).count();
            wrong.push(format!(
                "{:?}: first difference at {at}: got {:?}, llama.cpp {:?}",
                c.text.chars().take(60).collect::<String>(),
                &got[at..got.len().min(at + 8)],
                &c.ids[at..c.ids.len().min(at + 8)],
            ));
        }
    }
    let mut pieces = 0;
    if let Some(want) = &v.pieces {
        assert_eq!(want.len(), t.vocab_size(), "{name}: vocabulary size");
        for (id, hex) in want.iter().enumerate() {
            let want = unhex(hex);
            let got = t.token_bytes(id as u32).unwrap();
            if got != want.as_slice() {
                wrong.push(format!(
                    "token {id}: piece {:?}, llama.cpp {:?}",
                    String::from_utf8_lossy(got),
                    String::from_utf8_lossy(&want)
                ));
            }
        }
        pieces = want.len();
    }
    let mut eog = t.eog_tokens().to_vec();
    eog.sort_unstable();
    if eog != v.eog {
        wrong.push(format!("end-of-generation tokens {eog:?}, llama.cpp {:?}", v.eog));
    }
    assert!(
        wrong.is_empty(),
        "{name}: {} disagreements with llama.cpp:\n{}",
        wrong.len(),
        wrong.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
    let text_tokens = v.cases[0].ids.len();
    println!(
        "{name}: {} strings, {tokens} token ids ({text_tokens} for the whole text) and {pieces} pieces identical to llama.cpp",
        v.cases.len()
    );
}

#[test]
fn spm() {
    check("spm");
}

#[test]
fn spm_without_space_prefix_with_eos() {
    check("spm-noprefix-eos");
}

#[test]
fn bpe_without_pre() {
    check("bpe-nopre");
}

#[test]
fn bpe_default() {
    check("bpe-default");
}

#[test]
fn bpe_gpt2() {
    check("bpe-gpt-2");
}

#[test]
fn bpe_smollm() {
    check("bpe-smollm");
}

#[test]
fn bpe_starcoder() {
    check("bpe-starcoder");
}

#[test]
fn bpe_llama3() {
    check("bpe-llama-bpe");
}

#[test]
fn bpe_dbrx() {
    check("bpe-dbrx");
}

#[test]
fn bpe_glm4() {
    check("bpe-glm4");
}

#[test]
fn bpe_qwen2() {
    check("bpe-qwen2");
}

#[test]
fn bpe_tekken() {
    check("bpe-tekken");
}

#[test]
fn bpe_deepseek_llm() {
    check("bpe-deepseek-llm");
}

#[test]
fn bpe_deepseek_coder() {
    check("bpe-deepseek-coder");
}
