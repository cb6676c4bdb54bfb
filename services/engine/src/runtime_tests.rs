//! The architectures' options on the tiny model, each pinned by a property that needs no
//! reference implementation: an option set to its identity (factors of 1, zero biases) changes
//! no bit, two spellings of one rotation (frequency factors of 2, linear scaling by 2) agree bit
//! for bit, a zero norm weight cuts its projection out of the result, and NEOX RoPE on Hugging
//! Face's row order is normal RoPE on the rows as llama's conversion permutes them.
//! `tests/architectures.rs` checks the same code against llama.cpp on real-sized files.

use std::sync::Arc;

use pdmesh_kernels::Cut;

use crate::gguf::writer::GgufBuilder;
use crate::gguf::{GgufFile, Value};
use crate::testing::{TinyArch, TinyModel};
use crate::{Engine, EngineConfig, Logits, Model, StepItem};

/// A change to one tensor's bytes.
type Edit = Box<dyn FnOnce(&mut Vec<u8>)>;

fn load(b: GgufBuilder) -> Arc<Model> {
    let g = GgufFile::from_bytes(b.build()).expect("the GGUF parses");
    Arc::new(Model::from_gguf(g, "tiny.gguf".into()).expect("the model loads"))
}

fn tiny(arch: TinyArch) -> GgufBuilder {
    TinyModel { arch, ..Default::default() }.builder()
}

/// Every position's logits for a prompt long enough that RoPE turns through many angles.
fn logits(m: Arc<Model>) -> Vec<f32> {
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 250).collect();
    let cfg = EngineConfig { threads: 1, kv_blocks: 32, ..Default::default() };
    let mut e = Engine::new(m, cfg).expect("engine");
    let seq = e.create_sequence();
    let l = e.step(&[StepItem::prefill(seq, &prompt, Logits::All)]).expect("step");
    (0..l.len()).flat_map(|i| l.row(i).1.to_vec()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn f32_bytes(n: usize, v: f32) -> Vec<u8> {
    (0..n).flat_map(|_| v.to_le_bytes()).collect()
}

/// Sets every f32 of a tensor's data to `v`.
fn fill(v: f32) -> impl FnOnce(&mut Vec<u8>) {
    move |d: &mut Vec<u8>| *d = f32_bytes(d.len() / 4, v)
}

fn per_layer(mut b: GgufBuilder, name: &str, f: impl Fn() -> Edit) -> GgufBuilder {
    for l in 0..2 {
        b = b.map_tensor(&format!("blk.{l}.{name}"), f());
    }
    b
}

#[test]
fn freq_factors_divide_each_pairs_angle() {
    let plain = logits(load(tiny(TinyArch::Llama)));
    let ones = logits(load(tiny(TinyArch::Llama3).map_tensor("rope_freqs.weight", fill(1.0))));
    assert_eq!(bits(&ones), bits(&plain), "factors of 1 change nothing");

    // Dividing every angle by 2 is linear scaling by 2 (a freq_scale of 0.5): both exact.
    let twos = logits(load(tiny(TinyArch::Llama3).map_tensor("rope_freqs.weight", fill(2.0))));
    let linear = logits(load(
        tiny(TinyArch::Llama)
            .kv("llama.rope.scaling.type", Value::String("linear".into()))
            .kv("llama.rope.scaling.factor", Value::F32(2.0)),
    ));
    assert_eq!(bits(&twos), bits(&linear));
    assert_ne!(bits(&twos), bits(&plain));
    // Without a type, llama.cpp's default is linear: the factor alone scales.
    let untyped =
        logits(load(tiny(TinyArch::Llama).kv("llama.rope.scaling.factor", Value::F32(2.0))));
    assert_eq!(bits(&untyped), bits(&linear));
    // `none` ignores the factor.
    let none = logits(load(
        tiny(TinyArch::Llama)
            .kv("llama.rope.scaling.type", Value::String("none".into()))
            .kv("llama.rope.scaling.factor", Value::F32(2.0)),
    ));
    assert_eq!(bits(&none), bits(&plain));

    let llama3 = load(tiny(TinyArch::Llama3));
    assert!(llama3.rope_freqs.is_some());
    assert_ne!(bits(&logits(llama3)), bits(&plain), "the random factors rotate otherwise");
}

#[test]
fn qkv_biases_are_added_after_the_projections() {
    let with = logits(load(tiny(TinyArch::Qwen2)));
    let without = logits(load(tiny(TinyArch::Qwen2).remove_tensors(|n| n.ends_with(".bias"))));
    let zero = tiny(TinyArch::Qwen2);
    let zero = ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        .into_iter()
        .fold(zero, |b, name| per_layer(b, name, || Box::new(fill(0.0))));
    assert_eq!(bits(&logits(load(zero))), bits(&without), "zero biases change nothing");
    assert_ne!(bits(&with), bits(&without));
    // Each bias on its own matters.
    for name in ["attn_q.bias", "attn_k.bias", "attn_v.bias"] {
        let one = per_layer(tiny(TinyArch::Qwen2), name, || Box::new(fill(0.0)));
        assert_ne!(bits(&logits(load(one))), bits(&with), "{name}");
    }
}

#[test]
fn qk_norms_weigh_every_head_before_attention() {
    let m = load(tiny(TinyArch::Qwen3));
    let c = &m.config;
    assert_eq!((c.hidden, c.heads, c.head_dim, c.q_dim()), (64, 4, 32, 128));
    assert_eq!(m.kv_layout(16, pdmesh_kernels::KvDtype::F16).geometry.head_dim, 32);
    let base = logits(m);

    // Swapping two rows of attn_k changes K, so it changes the logits...
    let row = 64 / 32 * 20; // a Q4_1 row of 64 columns
    let swap = || -> Edit {
        Box::new(move |d: &mut Vec<u8>| {
            let (a, b) = d.split_at_mut(row);
            a.swap_with_slice(&mut b[..row]);
        })
    };
    let swapped = logits(load(per_layer(tiny(TinyArch::Qwen3), "attn_k.weight", swap)));
    assert_ne!(bits(&swapped), bits(&base));
    // ...unless a zero norm weight on K, or on Q, makes every score zero whatever K is.
    for norm in ["attn_k_norm.weight", "attn_q_norm.weight"] {
        let zeroed = per_layer(tiny(TinyArch::Qwen3), norm, || Box::new(fill(0.0)));
        let a = logits(load(zeroed));
        let zeroed = per_layer(tiny(TinyArch::Qwen3), norm, || Box::new(fill(0.0)));
        let b = logits(load(per_layer(zeroed, "attn_k.weight", swap)));
        assert_eq!(bits(&a), bits(&b), "{norm}");
        assert_ne!(bits(&a), bits(&base), "{norm}");
    }
}

/// Gemma 3's window: a window past the prompt is full attention (with the window layers'
/// RoPE base set to the model's, no bit differs from a model without one); a window of 8
/// changes nothing before position 8 and every position from it on; and a prompt computed in
/// chunks of 3 (each chunk's queries reaching back into the last) gives the bits of one step.
#[test]
fn a_sliding_window_masks_exactly_the_keys_before_it() {
    let gemma = || tiny(TinyArch::Gemma3).set_kv("gemma3.rope.freq_base_swa", Value::F32(10_000.0));
    let windowed = load(gemma());
    assert_eq!(windowed.config.window(0), Some(pdmesh_model::testing::TINY_WINDOW));
    assert_eq!(windowed.config.window(1), None, "a pattern of 2: every other layer global");
    let none = logits(load(gemma().remove_kv("gemma3.attention.sliding_window")));
    let wide = logits(load(gemma().set_kv("gemma3.attention.sliding_window", Value::U32(64))));
    assert_eq!(bits(&wide), bits(&none), "a window past the prompt is full attention");
    let eight = logits(Arc::clone(&windowed));
    let v = windowed.config.vocab;
    let row = |l: &[f32], i: usize| bits(&l[i * v..(i + 1) * v]);
    for i in 0..40 {
        assert_eq!(row(&eight, i) == row(&none, i), i < 8, "position {i}");
    }
    // Chunked: the same bits.
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 250).collect();
    let cfg = EngineConfig { threads: 2, kv_blocks: 32, ..Default::default() };
    let mut e = Engine::new(windowed, cfg).expect("engine");
    let seq = e.create_sequence();
    let mut chunked = Vec::new();
    for c in prompt.chunks(3) {
        let l = e.step(&[StepItem::prefill(seq, c, Logits::All)]).expect("step");
        chunked.extend((0..l.len()).flat_map(|i| l.row(i).1.to_vec()));
    }
    assert_eq!(bits(&chunked), bits(&eight), "chunks of 3");
    // And the window layers' own RoPE base is used.
    let base100 = logits(load(tiny(TinyArch::Gemma3)));
    assert_ne!(bits(&base100), bits(&eight), "rope.freq_base_swa is read");
}

#[test]
fn neox_rope_is_normal_rope_on_conversions_permuted_rows() {
    // convert_hf_to_gguf.py permutes llama's Q and K rows so that normal RoPE's adjacent pairs
    // are Hugging Face's (i, i + head_dim / 2): GGUF row 2j + s of a head is HF row
    // s * head_dim / 2 + j. Qwen keeps HF's order and rotates with NEOX instead.
    let hd = TinyArch::Llama.head_dim();
    let row = 64 / 32 * 20; // a Q4_1 row of 64 columns
    let permute = || -> Edit {
        Box::new(move |d: &mut Vec<u8>| {
            let src = d.clone();
            for (r, out) in d.chunks_exact_mut(row).enumerate() {
                let (head, within) = (r / hd, r % hd);
                let (j, s) = (within / 2, within % 2);
                let from = head * hd + s * hd / 2 + j;
                out.copy_from_slice(&src[from * row..(from + 1) * row]);
            }
        })
    };
    let qwen = logits(load(tiny(TinyArch::Qwen2).remove_tensors(|n| n.ends_with(".bias"))));
    let llama = tiny(TinyArch::Llama);
    let llama = per_layer(per_layer(llama, "attn_q.weight", permute), "attn_k.weight", permute);
    let llama = logits(load(llama));
    let unpermuted = logits(load(tiny(TinyArch::Llama)));
    // Within a tolerance only: the attention's dot products add a head's dimensions in another
    // order, which may round otherwise.
    let (same, other) = (max_diff(&qwen, &llama), max_diff(&qwen, &unpermuted));
    assert!(same < 1e-4 && other > 1e-2, "permuted {same}, unpermuted {other}");
}

/// A step whose items all ask for `Logits::Cut` gives each its candidates and no logits; one
/// item asking for logits makes the whole step give logits (the others sample from them).
#[test]
fn a_step_of_cut_items_gives_candidates_not_logits() {
    let m = crate::testing::tiny_model();
    let cfg = EngineConfig { threads: 1, kv_blocks: 32, ..Default::default() };
    let prompts: [Vec<u32>; 2] = [(3..14).collect(), (40..45).collect()];
    let step = |kinds: [Logits; 2]| {
        let mut e = Engine::new(Arc::clone(&m), cfg.clone()).expect("engine");
        let seqs = [e.create_sequence(), e.create_sequence()];
        let items: Vec<StepItem<'_>> =
            (0..2).map(|i| StepItem::prefill(seqs[i], &prompts[i], kinds[i])).collect();
        let l = e.step(&items).expect("step");
        let cands = |i| l.candidates_of(i).map(<[(u32, f32)]>::to_vec);
        (0..2).map(|i| (l.last_of(i).map(<[f32]>::to_vec), cands(i))).collect::<Vec<_>>()
    };
    let full = step([Logits::Last, Logits::Last]);
    let cuts = [Cut::GREEDY, Cut { scale: 1.0 / 0.8, margin: 30.0, top_k: 7 }];
    let cut = step(cuts.map(Logits::Cut));
    for i in 0..2 {
        let mut want = Vec::new();
        cuts[i].apply(full[i].0.as_deref().expect("logits"), &mut want);
        assert!(want.len() >= [1, 7][i], "item {i}: {want:?}");
        assert_eq!(cut[i], (None, Some(want)), "item {i}");
    }
    let mixed = step([Logits::Cut(Cut::GREEDY), Logits::Last]);
    assert_eq!(mixed, full, "a step with logits wanted gives them to every item");
}

/// The whole forward pass with the CUDA backend's bounded kernels on the emulated device
/// (`CudaOptions`: prompt matmuls on the int8 tensor cores, flash attention's running softmax,
/// each alone and both): a 40-token prompt and a batch of three, every token's logits, against
/// the CPU backend. The kernels round differently (`cuda_backend.rs` bounds each matmul at
/// ~1e-7 relative, each attention output at ~2^-10 of its values), but a difference that
/// flips one Q8 activation quant moves it by 1/254 of its block's largest, and that travels:
/// scaling half of layer 0's norm weights by 1 + 2^-20 moves the CPU's own logits by 0.9% of
/// a row's largest. So the model-level check is loose — within 2^-4 of each row's largest
/// and the same greedy picks on all 63 rows — and catches a broken kernel, not rounding.
#[test]
fn bounded_kernels_stay_near_the_cpu_backends_logits() {
    let m = crate::testing::tiny_model();
    let prompts: [Vec<u32>; 3] =
        [(3..43).collect(), (40..49).collect(), (7..100).step_by(7).collect()];
    let run = |backend| {
        let cfg = EngineConfig { threads: 1, kv_blocks: 32, backend, ..Default::default() };
        let mut e = Engine::new(Arc::clone(&m), cfg).expect("engine");
        let seqs: Vec<_> = prompts.iter().map(|_| e.create_sequence()).collect();
        let items: Vec<StepItem<'_>> =
            seqs.iter().zip(&prompts).map(|(&s, p)| StepItem::prefill(s, p, Logits::All)).collect();
        let l = e.step(&items).expect("step");
        (0..l.len()).map(|i| l.row(i).1.to_vec()).collect::<Vec<_>>()
    };
    let want = run(crate::BackendKind::Cpu { simd: None });
    for (mma, flash) in [(true, false), (false, true), (true, true)] {
        let opts = crate::CudaOptions { mma, flash };
        let got = run(crate::BackendKind::CudaEmu { opts });
        assert_eq!(got.len(), want.len());
        let (mut worst, mut exact) = (0f32, 0usize);
        for (g, w) in got.iter().zip(&want) {
            let top = w.iter().fold(0f32, |a, v| a.max(v.abs()));
            worst = worst.max(max_diff(g, w) / top);
            exact += usize::from(bits(g) == bits(w));
            assert_eq!(pdmesh_kernels::argmax(g), pdmesh_kernels::argmax(w), "{opts:?}");
        }
        eprintln!("{opts:?}: {exact} of {} rows bit-identical, worst {worst:e}", got.len());
        assert!(exact < got.len(), "{opts:?}: every row the CPU's bits: the kernels did not run");
        assert!(worst <= 2f32.powi(-4), "{opts:?}: logits differ by {worst} of a row's largest");
    }
}

/// Every architecture's forward pass on the CUDA backend (its emulated device) against the
/// CPU backend, bit for bit, at a length the kernel tests do not reach: a 300-token prompt
/// (19 attention tiles, the last ragged; prompt matmuls past their first token tiles; 19 KV
/// blocks) with every position's logits, then three generated tokens. Run under
/// AddressSanitizer (`just test-emu-asan`), it also checks that no kernel reads or writes
/// outside its buffers at this length.
#[test]
fn cuda_backend_gives_the_cpu_backends_bits_on_a_long_prompt_in_every_architecture() {
    for arch in [TinyArch::Llama, TinyArch::Llama3, TinyArch::Qwen2, TinyArch::Qwen3] {
        let m = load(TinyModel { arch, context: 512, ..Default::default() }.builder());
        let prompt: Vec<u32> = (0..300).map(|i| (i * 37 + 5) % 250).collect();
        let run = |backend| {
            let cfg = EngineConfig {
                threads: 1,
                kv_blocks: 24,
                max_batch_tokens: 300,
                backend,
                ..Default::default()
            };
            let mut e = Engine::new(Arc::clone(&m), cfg).expect("engine");
            let seq = e.create_sequence();
            let l = e.step(&[StepItem::prefill(seq, &prompt, Logits::All)]).expect("prefill");
            let mut rows: Vec<Vec<f32>> = (0..l.len()).map(|i| l.row(i).1.to_vec()).collect();
            for _ in 0..3 {
                let next = [pdmesh_kernels::argmax(rows.last().expect("a row"))];
                let l = e.step(&[StepItem::decode(seq, &next)]).expect("decode");
                rows.push(l.row(0).1.to_vec());
            }
            rows
        };
        let want = run(crate::BackendKind::Cpu { simd: None });
        let got = run(crate::BackendKind::CudaEmu { opts: Default::default() });
        assert_eq!(got.len(), 303, "{arch:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(bits(g) == bits(w), "{arch:?} row {i}: differs by {}", max_diff(g, w));
        }
    }
}
