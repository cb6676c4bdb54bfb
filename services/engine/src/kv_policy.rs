//! The engine's side of the lossy KV policies (`pdmesh_kv_types::KvPolicy`): a sequence under
//! one has full blocks evicted after each step (`KvCache::enforce`), and a score-driven one has
//! the attention its blocks receive summed by the forward pass's probes.

pub use pdmesh_kv_types::KvPolicy;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{BuildModel, TinyArch, TinyModel};
    use crate::{Engine, EngineConfig, Logits, SeqId, StepItem};

    fn engine(arch: TinyArch, blocks: usize) -> Engine {
        let m = TinyModel { arch, ..Default::default() }.build();
        Engine::new(m, EngineConfig { threads: 1, kv_blocks: blocks, ..Default::default() })
            .expect("engine")
    }

    fn text(n: usize) -> Vec<u32> {
        (0..n).map(|i| ((i * 37 + 11) % 250) as u32).collect()
    }

    /// Feeds `tokens` to `seq` `chunk` at a time; the last step's last logits.
    fn feed(e: &mut Engine, seq: SeqId, tokens: &[u32], chunk: usize) -> Vec<f32> {
        let mut last = Vec::new();
        for c in tokens.chunks(chunk) {
            let l = e.step(&[StepItem::prefill(seq, c, Logits::Last)]).expect("step");
            last = l.row(0).1.to_vec();
        }
        last
    }

    /// A sequence streaming four budgets' worth of tokens holds at most its budget after
    /// every step, its positions run on, and the pool gets the evicted blocks back.
    #[test]
    fn a_streaming_sequence_holds_its_budget_and_returns_what_it_evicts() {
        for policy in ["sinks:48", "h2o:48:16"] {
            let policy: KvPolicy = policy.parse().unwrap();
            let mut e = engine(TinyArch::Llama, 16);
            let seq = e.create_sequence();
            e.set_kv_policy(seq, Some(policy)).unwrap();
            let toks = text(200);
            for (i, c) in toks.chunks(16).enumerate() {
                e.step(&[StepItem::prefill(seq, c, Logits::Last)]).unwrap();
                let fed = (16 * (i + 1)).min(200);
                let len = e.seq_len(seq).unwrap();
                assert!(len <= 48, "{policy}: {len} tokens held after {fed}");
                assert_eq!(len + e.evicted_tokens(seq).unwrap(), fed, "{policy}");
                assert_eq!(e.seq_position(seq).unwrap(), fed, "{policy}");
                assert_eq!(e.kv().free_blocks(), 16 - len.div_ceil(16), "{policy}: leaked");
            }
            e.free_sequence(seq).unwrap();
            assert_eq!(e.kv().free_blocks(), 16);
        }
    }

    /// Nothing evicted is read again: after the policy frees blocks, another sequence takes
    /// them and writes its own KV there, and the policy's sequence computes the same bits.
    #[test]
    fn evicted_blocks_are_never_read_again() {
        let run = |scribble: bool| {
            let mut e = engine(TinyArch::Llama, 12);
            let seq = e.create_sequence();
            e.set_kv_policy(seq, Some("sinks:48".parse().unwrap())).unwrap();
            feed(&mut e, seq, &text(100), 16);
            assert_eq!(e.evicted_tokens(seq).unwrap(), 64);
            if scribble {
                let other = e.create_sequence();
                let junk: Vec<u32> =
                    (0..e.kv().free_blocks() * 16).map(|i| (i % 200) as u32).collect();
                e.step(&[StepItem::prefill(other, &junk, Logits::None)]).unwrap();
                assert_eq!(e.kv().free_blocks(), 0, "the evicted blocks were all reused");
            }
            feed(&mut e, seq, &text(8), 4)
        };
        let (clean, scribbled) = (run(false), run(true));
        assert_eq!(
            clean.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            scribbled.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    /// Eviction changes what attention sees: the same tokens give other logits under a policy
    /// once past its budget, and the same ones before.
    #[test]
    fn a_policy_changes_nothing_before_its_budget_and_something_after() {
        let run = |policy: Option<KvPolicy>, n: usize| {
            let mut e = engine(TinyArch::Llama, 16);
            let seq = e.create_sequence();
            e.set_kv_policy(seq, policy).unwrap();
            feed(&mut e, seq, &text(n), 16)
        };
        let p = Some("sinks:64".parse().unwrap());
        assert_eq!(run(None, 64), run(p, 64));
        assert_ne!(run(None, 160), run(p, 160));
    }

    /// The mass a probe hands out is its softmax: one per head and full-attention layer, for
    /// every step of the sequence (nothing evicted under a budget it never reaches). Gemma 3's
    /// windowed layers give none.
    #[test]
    fn attention_mass_sums_to_one_per_head_layer_and_probe() {
        for (arch, full_layers) in [(TinyArch::Llama, 2.0), (TinyArch::Gemma3, 1.0)] {
            let mut e = engine(arch, 16);
            let c = e.model().config.clone();
            let full = c
                .sliding_window
                .as_ref()
                .map_or(c.layers, |w| w.local.iter().filter(|&&l| !l).count());
            assert_eq!(full as f32, full_layers, "{arch:?}");
            let seq = e.create_sequence();
            e.set_kv_policy(seq, Some("h2o:240:16".parse().unwrap())).unwrap();
            let steps = 5;
            feed(&mut e, seq, &text(16 * steps), 16);
            let mass: f32 = e.kv().mass(seq).unwrap().unwrap().iter().sum();
            let want = (steps * c.heads) as f32 * full_layers;
            assert!((mass - want).abs() < 1e-3 * want, "{arch:?}: {mass} vs {want}");
        }
    }

    #[test]
    fn an_engine_refuses_a_policy_its_blocks_cannot_hold() {
        let mut e = engine(TinyArch::Llama, 8);
        let seq = e.create_sequence();
        let e2 = e.set_kv_policy(seq, Some("sinks:40".parse().unwrap())).unwrap_err();
        assert!(e2.to_string().contains("48 tokens"), "{e2}");
        // Refused, it left none behind: 100 tokens keep all their KV.
        feed(&mut e, seq, &text(100), 16);
        assert_eq!((e.seq_len(seq).unwrap(), e.evicted_tokens(seq).unwrap()), (100, 0));
    }
}
