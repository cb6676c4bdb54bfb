//! The tiny seeded model of `pdmesh_model::testing`, loaded with its weights: what the fast
//! tier of tests (cores, batch runner, relay, prefill) computes with. Enabled for tests and by
//! the `testing` feature.

use std::sync::Arc;

pub use pdmesh_model::testing::{HIDDEN, SPECIALS, TINY_WINDOW, TinyArch, TinyModel, tiny_card};

use crate::model::Model;

/// Loads a tiny model's weights.
pub trait BuildModel {
    fn build(&self) -> Arc<Model>;
}

impl BuildModel for TinyModel {
    fn build(&self) -> Arc<Model> {
        Arc::new(Model::from_gguf(self.file(), "tiny.gguf".into()).expect("the tiny model loads"))
    }
}

/// The default tiny model, built once per process.
pub fn tiny_model() -> Arc<Model> {
    static M: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
    Arc::clone(M.get_or_init(|| TinyModel::default().build()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Engine, EngineConfig, GenerateParams, generate};

    #[test]
    fn the_tiny_model_loads_tokenizes_and_generates_deterministically() {
        let m = tiny_model();
        assert_eq!((m.config.layers, m.config.hidden, m.config.head_dim), (2, 64, 16));
        let ids = m.tokenizer.encode("the one and the two").expect("encodes");
        assert!(ids.len() < "the one and the two".len(), "merges make words single tokens");
        assert_eq!(m.tokenizer.decode(&ids), "the one and the two");
        let chat = m.tokenizer.chat_template().expect("a template");
        let text =
            chat.render(&[crate::Message::new("user", "hi".to_string())], true).expect("renders");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");
        let run = |seed| {
            let mut e = Engine::new(
                TinyModel { seed, ..Default::default() }.build(),
                EngineConfig { threads: 1, kv_blocks: 32, ..Default::default() },
            )
            .expect("engine");
            let p = GenerateParams { max_tokens: 12, ignore_eos: true, ..Default::default() };
            generate(&mut e, &ids, &p, |_| true).expect("generates").tokens
        };
        let a = run(7);
        assert_eq!(a.len(), 12);
        assert_eq!(a, run(7), "one seed, one output");
        assert_ne!(a, run(8), "another seed, other weights");
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 1, "the model is not stuck on one token: {a:?}");
    }
}
