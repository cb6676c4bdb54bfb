//! A sliding-window model's KV through the in-process mesh: the blocks before the window of
//! the token after the prompt travel thin (their global layers only) by every transport and
//! push mode, verified by checksums, and decoding continues with one engine's tokens.

use pdmesh_engine::testing::TinyArch;
use pdmesh_kv_transfer::{PushMode, TransportKind};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_windowed_models_kv_goes_thin_by_every_transport_and_push_mode() {
    let gemma = TinyModel { arch: TinyArch::Gemma3, ..Default::default() };
    let want = {
        let cfg = EngineConfig { threads: 1, kv_blocks: 64, block_size: 4, ..Default::default() };
        let mut e = Engine::new(gemma.build(), cfg).unwrap();
        let p = GenerateParams { max_tokens: 12, ignore_eos: true, ..Default::default() };
        pdmesh_engine::generate(&mut e, &prompt(), &p, |_| true).unwrap().tokens
    };
    // The mesh's blocks are 4 tokens: the token after the 21-token prompt sees 14..=21 through
    // the tiny Gemma's 8-token window, so blocks 0..3 (tokens 0..12) go as layer 1 alone.
    let settings = Settings::new(1, 1);
    let dtype = settings.prefill[0].engine.kv_dtype.parse().unwrap();
    let layout = gemma.card().config.kv_layout(0, 4, dtype);
    let thin = layout.thin_blocks(prompt().len());
    assert_eq!((thin, prompt().len().div_ceil(4)), (3, 6));
    let thin_bytes = layout.wire_bytes(0, 6, thin) as u64;
    assert!(thin_bytes < 6 * layout.bytes_per_block() as u64);
    for (transport, name) in [(TransportKind::Grpc, "grpc"), (TransportKind::named("ucx"), "ucx")] {
        for push in [PushMode::Layer, PushMode::Chunk, PushMode::Prompt] {
            let mut s = settings.clone();
            s.model = gemma;
            s.prefill[0].kv_transport = transport.clone();
            s.prefill[0].kv_push = push;
            s.prefill[0].kv_verify = true;
            let m = s.start().await;
            let (tokens, f) = generate(&m, req(12)).await.unwrap();
            assert_eq!(tokens, want, "{name} {push}");
            let t = f.timings.unwrap();
            assert_eq!((t.kv_transport.as_str(), t.kv_bytes), (name, thin_bytes), "{push}");
        }
    }
}
