//! Twenty chat prompts, half greedy and half seeded, and the tokens `pdmesh run` gives for
//! each on one engine: what every mesh, however its nodes fail or move, must give too.

use pdmesh_proto::v1::{Chat, ChatMessage, GenerateRequest, SamplingParams, generate_request};

use crate::{pdmesh, run};

pub const PROMPTS: [&str; 20] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "What does a compiler do?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "Why do leaves change color in autumn?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is 12 times 12?",
    "Describe the smell of rain.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet turtle.",
    "What is the largest planet in our solar system?",
    "Explain what a black hole is to a child.",
    "Write a short motto for a bakery.",
    "What language is spoken in Brazil?",
    "How do bees make honey?",
];

/// (temperature, top_p, seed) for prompt i: even prompts greedy, odd ones seeded sampling.
pub fn sampling(i: usize) -> (f32, f32, u64) {
    if i.is_multiple_of(2) { (0.0, 1.0, 0) } else { (0.8, 0.95, 1000 + i as u64) }
}

/// `pdmesh run`'s tokens for prompt i (chat template applied), at most `max_tokens`.
pub fn reference(i: usize, max_tokens: u32) -> Vec<u32> {
    reference_with(i, max_tokens, &[])
}

/// `reference` with `extra` flags for the engine.
pub fn reference_with(i: usize, max_tokens: u32, extra: &[&str]) -> Vec<u32> {
    let v = run_json_with(PROMPTS[i], max_tokens, sampling(i), extra);
    let ids = v["token_ids"].as_array().expect("token_ids");
    ids.iter().map(|x| x.as_u64().expect("a token id") as u32).collect()
}

/// `pdmesh run --json`'s answer for `prompt` (chat template applied) with (temperature,
/// top_p, seed): `text`, `token_ids` and the rest.
pub fn run_json(prompt: &str, max_tokens: u32, sampling: (f32, f32, u64)) -> serde_json::Value {
    run_json_with(prompt, max_tokens, sampling, &[])
}

/// `run_json` with `extra` flags for the engine (e.g. `--kv-dtype q8_0`).
pub fn run_json_with(
    prompt: &str,
    max_tokens: u32,
    (t, p, seed): (f32, f32, u64),
    extra: &[&str],
) -> serde_json::Value {
    let mut c = pdmesh(&[
        "run",
        "--prompt",
        prompt,
        "--max-tokens",
        &max_tokens.to_string(),
        "--temperature",
        &t.to_string(),
        "--top-p",
        &p.to_string(),
        "--seed",
        &seed.to_string(),
        "--json",
    ]);
    c.args(extra);
    let (code, out, err) = run(c);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(out.trim()).expect("`pdmesh run --json`")
}

/// The Generate request that asks the mesh what `reference(i, max_tokens)` is.
pub fn request(i: usize, max_tokens: u32) -> GenerateRequest {
    let (t, p, seed) = sampling(i);
    GenerateRequest {
        input: Some(generate_request::Input::Chat(Chat {
            messages: vec![ChatMessage { role: "user".into(), content: PROMPTS[i].into() }],
        })),
        max_tokens,
        sampling: Some(SamplingParams {
            temperature: t,
            top_p: Some(p),
            seed: Some(seed),
            ..Default::default()
        }),
        ..Default::default()
    }
}
