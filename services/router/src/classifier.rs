//! The up-front tier classifier: for a request for `auto`, the chance that each cheaper model
//! of the ladder answers it well, from the words of the request alone, before any model runs.
//! A logistic regression per model over binary word and word-pair features, trained offline
//! (`scripts/train_tiers.py`) on the graded task set's answers; the file it writes carries
//! sample texts with their expected scores, so a router whose features drifted from the
//! trainer's refuses the file instead of routing on garbage.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use serde::Deserialize;

/// Largest classifier file read: a few thousand weights per model fit in far less.
const MAX_FILE_BYTES: u64 = 16 << 20;
/// How far a recomputed check score may stray from the trainer's (both are f64 sums of the
/// same few weights; only the order of additions differs).
const CHECK_TOLERANCE: f64 = 1e-9;
/// The feature scheme this router computes; the file must name the same.
const FEATURES: &str = "ascii-words+pairs+len/v1";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    features: String,
    /// Per model id: its bias and feature weights.
    models: HashMap<String, Weights>,
    /// Texts and the score each model's regression gave them when trained.
    checks: Vec<Check>,
    /// Free-form provenance (what it was trained on); not read.
    #[serde(default)]
    #[allow(dead_code)]
    about: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Weights {
    bias: f64,
    weights: HashMap<String, f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Check {
    text: String,
    p: HashMap<String, f64>,
}

/// A loaded, checked classifier.
#[derive(Debug, Clone, PartialEq)]
pub struct Classifier {
    models: HashMap<String, Weights>,
}

impl Classifier {
    /// Reads `path`, and checks that it scores every model of `ladder` but the last (the one
    /// that answers when none is likely to) and that its check texts score as trained.
    pub fn load(path: &Path, ladder: &[String]) -> Result<Self, String> {
        let shown = path.display();
        let len = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?.len();
        if len > MAX_FILE_BYTES {
            return Err(format!("{shown}: {len} bytes, more than {MAX_FILE_BYTES}"));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
        Self::parse(&text, ladder).map_err(|e| format!("{shown}: {e}"))
    }

    fn parse(text: &str, ladder: &[String]) -> Result<Self, String> {
        let file: File = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if file.features != FEATURES {
            return Err(format!(
                "features {:?}: this router computes {FEATURES:?}; retrain for it",
                file.features
            ));
        }
        let c = Self { models: file.models };
        let cheaper = &ladder[..ladder.len().saturating_sub(1)];
        if let Some(m) = cheaper.iter().find(|m| !c.models.contains_key(*m)) {
            let has: BTreeSet<_> = c.models.keys().collect();
            return Err(format!("no weights for ladder model {m:?} (it has {has:?})"));
        }
        if file.checks.is_empty() {
            return Err("no checks: nothing shows its features are this router's".into());
        }
        for (i, check) in file.checks.iter().enumerate() {
            for (model, want) in &check.p {
                let got = c
                    .p_correct(model, &check.text)
                    .ok_or_else(|| format!("checks[{i}]: model {model:?} has no weights"))?;
                if (got - want).abs() > CHECK_TOLERANCE {
                    return Err(format!(
                        "checks[{i}]: {model} scores {got} here, {want} when trained: the \
                         features differ from the trainer's"
                    ));
                }
            }
        }
        Ok(c)
    }

    /// The chance (0..1) that `model` answers `text` well; None for a model it has no
    /// weights for.
    pub fn p_correct(&self, model: &str, text: &str) -> Option<f64> {
        self.score(model, &features(text))
    }

    /// `p_correct` of text whose features are `f`.
    fn score(&self, model: &str, f: &BTreeSet<String>) -> Option<f64> {
        let w = self.models.get(model)?;
        let z = w.bias + f.iter().filter_map(|f| w.weights.get(f)).sum::<f64>();
        Some(1.0 / (1.0 + (-z).exp()))
    }

    /// The index into `ladder` of the model to run: the cheapest whose chance reaches
    /// `min_p`, else the last; with each cheaper model's chance, for the trace.
    pub fn choose(&self, ladder: &[String], text: &str, min_p: f64) -> (usize, Vec<f64>) {
        let last = ladder.len().saturating_sub(1);
        let f = features(text);
        let mut chances = Vec::with_capacity(last);
        for (k, model) in ladder[..last].iter().enumerate() {
            let p = self.score(model, &f).unwrap_or(0.0);
            chances.push(p);
            if p >= min_p {
                return (k, chances);
            }
        }
        (last, chances)
    }
}

/// The features of `text`: its ASCII words lowercased (a run of digits is the word `#`), each
/// word and each pair of neighbours once, and `len:K` for K = ⌊log2(words + 1)⌋.
/// `scripts/train_tiers.py` computes exactly these.
pub fn features(text: &str) -> BTreeSet<String> {
    // A word is a run of ASCII letters or of ASCII digits; anything else separates.
    let word = |cur: &str, digits: bool| if digits { "#".to_string() } else { cur.to_string() };
    let (mut words, mut cur, mut digits) = (Vec::new(), String::new(), false);
    for c in text.chars() {
        let (letter, digit) = (c.is_ascii_alphabetic(), c.is_ascii_digit());
        if !cur.is_empty() && (!(letter || digit) || digit != digits) {
            words.push(word(&cur, digits));
            cur.clear();
        }
        if letter || digit {
            digits = digit;
            cur.push(c.to_ascii_lowercase());
        }
    }
    if !cur.is_empty() {
        words.push(word(&cur, digits));
    }
    let mut f: BTreeSet<String> = words.iter().cloned().collect();
    f.extend(words.windows(2).map(|w| format!("{} {}", w[0], w[1])));
    f.insert(format!("len:{}", (words.len() + 1).ilog2()));
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(xs: &[&str]) -> BTreeSet<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    /// The same cases `scripts/train_tiers.py`'s self-test asserts: the two must agree.
    #[test]
    fn features_are_words_pairs_and_a_length_bucket() {
        assert_eq!(
            features("What is 17*23? Answer!"),
            set(&["what", "is", "#", "answer", "what is", "is #", "# #", "# answer", "len:2"])
        );
        assert_eq!(features(""), set(&["len:0"]));
        // Letters glued to digits are two words; non-ASCII letters separate.
        assert_eq!(
            features("ab12cd é x"),
            set(&["ab", "#", "cd", "x", "ab #", "# cd", "cd x", "len:2"])
        );
    }

    /// The shipped classifier (`just train-tiers`) loads, its checks pass under this router's
    /// features, and it sends what SmolLM2 answers well (a one-line function) to SmolLM2 and a
    /// word problem, which only the largest model sometimes solves, past it.
    #[test]
    fn the_shipped_classifier_loads_and_routes() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/config/tier-classifier.json");
        let ladder: Vec<String> = [
            "SmolLM2-135M-Instruct.Q4_1",
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-1.5b-instruct",
        ]
        .map(String::from)
        .into();
        let c = Classifier::load(&path, &ladder).unwrap();
        let easy = "Write a Python function `square(x)` that returns x squared. Reply with the \
                    code only, no explanation.";
        assert_eq!(c.choose(&ladder, easy, 0.7).0, 0);
        let hard = "What is 417 times 8? Answer with the number only.";
        assert!(c.choose(&ladder, hard, 0.7).0 > 0);
        let e = Classifier::load(&path, &["x".into(), "y".into()]).unwrap_err();
        assert!(e.contains("no weights for ladder model \"x\""), "{e}");
    }

    fn ladder() -> Vec<String> {
        vec!["small".into(), "mid".into(), "big".into()]
    }

    fn file(checks: &str) -> String {
        format!(
            r#"{{"features": "{FEATURES}",
                "models": {{"small": {{"bias": -1.0, "weights": {{"add": 3.0}}}},
                            "mid": {{"bias": 0.0, "weights": {{"add": 1.0, "code": 2.0}}}}}},
                "checks": {checks}}}"#
        )
    }

    #[test]
    fn the_cheapest_likely_model_answers() {
        let c = Classifier::parse(
            &file(r#"[{"text": "add", "p": {"small": 0.8807970779778823}}]"#),
            &ladder(),
        )
        .unwrap();
        assert_eq!(c.choose(&ladder(), "please add these", 0.7).0, 0);
        assert_eq!(c.choose(&ladder(), "write code", 0.7).0, 1);
        assert_eq!(c.choose(&ladder(), "a poem", 0.7).0, 2, "nothing likely: the last");
        let (k, chances) = c.choose(&ladder(), "a poem", 0.99);
        assert_eq!((k, chances.len()), (2, 2));
    }

    #[test]
    fn a_file_that_does_not_fit_is_refused_with_the_reason() {
        let ok = r#"[{"text": "add", "p": {"small": 0.8807970779778823}}]"#;
        for (text, why) in [
            (file(r#"[{"text": "add", "p": {"small": 0.5}}]"#), "features differ"),
            (file("[]"), "no checks"),
            (file(ok).replace(FEATURES, "bytes/v0"), "retrain"),
            (file(ok).replace("\"mid\"", "\"huge\""), "ladder model \"mid\""),
            ("{".to_string(), "EOF"),
        ] {
            let e = Classifier::parse(&text, &ladder()).unwrap_err();
            assert!(e.contains(why), "{why}: {e}");
        }
    }
}
