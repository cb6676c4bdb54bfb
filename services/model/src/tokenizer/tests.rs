//! The tokenizer on tiny vocabularies built in memory: SentencePiece merge order, byte fallback,
//! unknown characters, the space prefix, special tokens cut out of text the way llama.cpp does,
//! pieces, and the vocabularies refused at load. Agreement with llama.cpp on real-sized
//! vocabularies is `tests/vocab_fixtures.rs`.

use super::*;
use crate::gguf::writer::GgufBuilder;

fn s(x: &str) -> Value {
    Value::String(x.into())
}

const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// A SentencePiece vocabulary: `<unk> <s> </s>`, then `pieces` as (text, score, type), then
/// byte tokens for `bytes`. Extra metadata from `kv`.
fn spm(pieces: &[(&str, f32, i32)], bytes: &[u8], kv: &[(&str, Value)]) -> Tokenizer {
    let mut all: Vec<(String, f32, i32)> = vec![
        ("<unk>".into(), 0.0, UNKNOWN),
        ("<s>".into(), 0.0, CONTROL),
        ("</s>".into(), 0.0, CONTROL),
    ];
    all.extend(pieces.iter().map(|(t, sc, ty)| ((*t).to_string(), *sc, *ty)));
    all.extend(bytes.iter().map(|b| (format!("<0x{b:02X}>"), 0.0, BYTE)));
    let mut b = GgufBuilder::default()
        .kv("tokenizer.ggml.model", s("llama"))
        .kv("tokenizer.ggml.tokens", Value::Array(all.iter().map(|(t, _, _)| s(t)).collect()))
        .kv(
            "tokenizer.ggml.scores",
            Value::Array(all.iter().map(|(_, sc, _)| Value::F32(*sc)).collect()),
        )
        .kv(
            "tokenizer.ggml.token_type",
            Value::Array(all.iter().map(|(_, _, ty)| Value::I32(*ty)).collect()),
        );
    for (k, v) in kv {
        b = b.kv(k, v.clone());
    }
    Tokenizer::from_gguf(&GgufFile::from_bytes(b.build()).unwrap()).unwrap()
}

/// Token ids by text, for readable expectations.
fn ids(t: &Tokenizer, texts: &[&str]) -> Vec<u32> {
    texts
        .iter()
        .map(|x| {
            (0..t.vocab_size() as u32)
                .find(|&i| t.token_bytes(i) == Some(x.as_bytes()) || piece_text(t, i) == *x)
                .unwrap_or_else(|| panic!("no token {x:?}"))
        })
        .collect()
}

/// The token's text as written in the vocabulary (pieces show ▁ as a space).
fn piece_text(t: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(t.token_bytes(id).unwrap_or_default()).replace(' ', "▁")
}

fn no_prefix() -> Vec<(&'static str, Value)> {
    vec![
        ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
    ]
}

#[test]
fn spm_merges_the_best_scoring_pair_first() {
    // "abc": "ab" and "bc" are both pieces; the higher score wins whatever its position.
    let pieces = |ab: f32, bc: f32| {
        [
            ("a", -1.0, NORMAL),
            ("b", -1.0, NORMAL),
            ("c", -1.0, NORMAL),
            ("ab", ab, NORMAL),
            ("bc", bc, NORMAL),
        ]
    };
    let t = spm(&pieces(-5.0, -4.0), &[], &no_prefix());
    assert_eq!(t.encode("abc").unwrap(), ids(&t, &["a", "bc"]));
    let t = spm(&pieces(-4.0, -5.0), &[], &no_prefix());
    assert_eq!(t.encode("abc").unwrap(), ids(&t, &["ab", "c"]));
    // Equal scores: the leftmost pair.
    let t = spm(&pieces(-4.0, -4.0), &[], &no_prefix());
    assert_eq!(t.encode("abc").unwrap(), ids(&t, &["ab", "c"]));
}

#[test]
fn spm_merges_build_on_merges() {
    // "cd" (better) then "ab" merge first; only then can "abcd", the worst score, form.
    let t = spm(
        &[
            ("a", -1.0, NORMAL),
            ("b", -1.0, NORMAL),
            ("c", -1.0, NORMAL),
            ("d", -1.0, NORMAL),
            ("ab", -3.0, NORMAL),
            ("cd", -2.0, NORMAL),
            ("abcd", -9.0, NORMAL),
        ],
        &[],
        &no_prefix(),
    );
    assert_eq!(t.encode("abcd").unwrap(), ids(&t, &["abcd"]));
    assert_eq!(t.encode("abcda").unwrap(), ids(&t, &["abcd", "a"]));
}

#[test]
fn spm_space_prefix_and_escaping() {
    let pieces = [
        ("▁", -1.0, NORMAL),
        ("a", -1.0, NORMAL),
        ("b", -1.0, NORMAL),
        ("▁a", -2.0, NORMAL),
        ("▁b", -2.0, NORMAL),
    ];
    // The default: a space before the text, and BOS.
    let t = spm(&pieces, &[], &[]);
    let bos = t.bos().unwrap();
    let mut want = vec![bos];
    want.extend(ids(&t, &["▁a", "▁b"]));
    assert_eq!(t.encode("a b").unwrap(), want);
    assert_eq!(t.encode("").unwrap(), vec![bos]);
    // Again after each special token written in the text.
    let mut want = vec![bos];
    want.extend(ids(&t, &["▁a"]));
    want.push(t.eos().unwrap());
    want.extend(ids(&t, &["▁b"]));
    assert_eq!(t.encode("a</s>b").unwrap(), want);
    // add_space_prefix off: spaces are still ▁, but none is added.
    let t = spm(&pieces, &[], &no_prefix());
    assert_eq!(t.encode("a b").unwrap(), ids(&t, &["a", "▁b"]));
    assert_eq!(t.encode(" a").unwrap(), ids(&t, &["▁a"]));
    assert_eq!(t.encode("").unwrap(), Vec::<u32>::new());
}

#[test]
fn spm_spells_what_no_piece_covers_in_bytes_or_unknown() {
    // Ids: <unk> 0, <s> 1, </s> 2, "a" 3, then the byte tokens.
    let with_bytes = spm(&[("a", -1.0, NORMAL)], &[0xC3, 0xA9], &no_prefix());
    assert_eq!(with_bytes.encode("aé").unwrap(), vec![3, 4, 5]);
    // A byte token for one byte of a character but not the other: the character is unknown.
    let partial = spm(&[("a", -1.0, NORMAL)], &[0xC3], &no_prefix());
    assert_eq!(partial.encode("éa").unwrap(), vec![0, 3]);
    // No byte tokens at all: one <unk> per unknown character (id 0 unless the GGUF says).
    let plain = spm(&[("a", -1.0, NORMAL)], &[], &no_prefix());
    assert_eq!(plain.encode("a東京").unwrap(), vec![3, 0, 0]);
    let mut kv = no_prefix();
    kv.push(("tokenizer.ggml.unknown_token_id", Value::U32(3)));
    let named = spm(&[("<unk2>", 0.0, UNKNOWN)], &[], &kv);
    assert_eq!(named.encode("x").unwrap(), vec![3]);
}

#[test]
fn spm_pieces_are_the_bytes_a_token_stands_for() {
    // Ids: <unk> 0, <s> 1, </s> 2, "▁a" 3, "<tool>" 4, "<unused0>" 5, <0x41> 6, <0x0A> 7.
    let t = spm(
        &[("▁a", -1.0, NORMAL), ("<tool>", 0.0, USER_DEFINED), ("<unused0>", 0.0, UNUSED)],
        &[0x41, 0x0A],
        &[],
    );
    assert_eq!(t.token_bytes(3), Some(&b" a"[..]));
    assert_eq!(t.token_bytes(1), Some(&b"<s>"[..]));
    assert_eq!(t.token_bytes(0), Some(&b"<unk>"[..]));
    assert_eq!(t.token_bytes(4), Some(&b"<tool>"[..]));
    assert_eq!(t.token_bytes(5), Some(&b""[..]), "unused tokens yield nothing");
    assert_eq!(t.token_bytes(6), Some(&b"A"[..]));
    assert_eq!(t.token_bytes(7), Some(&b"\n"[..]));
    assert_eq!(t.token_bytes(8), None);
    assert_eq!(t.decode(&[6, 7, 3]), "A\n a");
}

#[test]
fn special_tokens_are_cut_out_longest_first_as_llama_cpp_does() {
    // "ab" and "bcd" overlap in "abcd". llama.cpp cuts the longest special out of the whole
    // text first, so "bcd" wins although "ab" starts earlier.
    let t = spm(
        &[
            ("ab", 0.0, CONTROL),
            ("bcd", 0.0, USER_DEFINED),
            ("a", -1.0, NORMAL),
            ("x", -1.0, NORMAL),
        ],
        &[],
        &no_prefix(),
    );
    assert_eq!(t.encode("abcd").unwrap(), vec![ids(&t, &["a"])[0], 4]);
    assert_eq!(t.encode("xabx").unwrap(), vec![ids(&t, &["x"])[0], 3, ids(&t, &["x"])[0]]);
    // Unknown-typed tokens written in text are recognised too.
    assert_eq!(t.encode("<unk>").unwrap(), vec![0]);
}

#[test]
fn end_of_turn_texts_become_control_tokens_and_end_generation() {
    // "<|im_end|>" typed as a normal piece: llama.cpp makes it a control token and an EOG.
    let t = spm(&[("<|im_end|>", -1.0, NORMAL), ("x", -1.0, NORMAL)], &[], &no_prefix());
    assert_eq!(t.encode("x<|im_end|>").unwrap(), vec![4, 3]);
    assert!(t.is_eog(3) && t.is_eog(2), "{:?}", t.eog_tokens());
    assert!(!t.is_eog(1));
}

fn bpe(kv: &[(&str, Value)]) -> Result<Tokenizer> {
    let mut b = GgufBuilder::default()
        .kv("tokenizer.ggml.tokens", Value::Array(vec![s("a"), s("b"), s("ab")]))
        .kv("tokenizer.ggml.merges", Value::Array(vec![s("a b")]));
    for (k, v) in kv {
        b = b.kv(k, v.clone());
    }
    Tokenizer::from_gguf(&GgufFile::from_bytes(b.build()).unwrap())
}

#[test]
fn unsupported_vocabularies_are_refused_by_name() {
    for kind in ["bert", "t5", "rwkv", "plamo2"] {
        let e = bpe(&[("tokenizer.ggml.model", s(kind))]).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.model") && e.contains(&format!("{kind:?}")), "{e}");
    }
    let e = bpe(&[("tokenizer.ggml.model", s("gpt2")), ("tokenizer.ggml.pre", s("klingon"))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.ggml.pre") && e.contains("\"klingon\""), "{e}");
    assert!(e.contains("qwen2") && e.contains("llama-bpe") && e.contains("tekken"), "{e}");
}

#[test]
fn bpe_defaults_follow_the_pre_tokenizer() {
    let model = ("tokenizer.ggml.model", s("gpt2"));
    let bos = ("tokenizer.ggml.bos_token_id", Value::U32(1));
    // No pre: llama.cpp's "default"; no BOS unless asked.
    let t = bpe(&[model.clone(), bos.clone()]).unwrap();
    assert_eq!(t.encode("ab").unwrap(), vec![2]);
    // llama-bpe and tekken add BOS unless the GGUF says otherwise.
    for pre in ["llama-bpe", "tekken"] {
        let t = bpe(&[model.clone(), bos.clone(), ("tokenizer.ggml.pre", s(pre))]).unwrap();
        assert_eq!(t.encode("ab").unwrap(), vec![1, 2], "{pre}");
        let off = ("tokenizer.ggml.add_bos_token", Value::Bool(false));
        let t = bpe(&[model.clone(), bos.clone(), ("tokenizer.ggml.pre", s(pre)), off]).unwrap();
        assert_eq!(t.encode("ab").unwrap(), vec![2], "{pre}");
    }
    // add_eos appends EOS.
    let eos = [
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
        ("tokenizer.ggml.add_eos_token", Value::Bool(true)),
    ];
    let t = bpe(&[model, eos[0].clone(), eos[1].clone()]).unwrap();
    assert_eq!(t.encode("ab").unwrap(), vec![2, 0]);
}
