//! `pdmesh generate`: stream a completion from a running mesh.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use pdmesh_proto::v1::{
    Chat, ChatMessage, FinishReason, GenerateRequest, SamplingParams, generate_request,
    generate_response,
};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt. Sent as a user chat message (the model's template applies) unless --raw.
    prompt: String,
    /// The router to call.
    #[arg(long, default_value = "127.0.0.1:50051")]
    target: String,
    /// The API key to send (default: that of the `pdmesh up` mesh at --target).
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Send the prompt as raw text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// A system message (chat mode only).
    #[arg(long, conflicts_with = "raw")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Nucleus sampling mass.
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Drop tokens below min_p × the best token's probability.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Penalty for recently seen tokens (1 = off).
    #[arg(long, allow_negative_numbers = true)]
    repetition_penalty: Option<f32>,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the output contains this string (repeat for several).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-turn tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// An opt-in lossy KV policy: `sinks:BUDGET[:SINKS]` or `h2o:BUDGET[:RECENT]` (budget in
    /// tokens); the finish line names it and what it evicted. Default: the tenant's, else
    /// full attention.
    #[arg(long)]
    kv_policy: Option<pdmesh_kv_types::KvPolicy>,
    /// Give up after this many seconds (sent as the call's deadline).
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// The served model to ask (a mesh may serve several: `ModelInfo` names the default);
    /// default: the router's default model.
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Print one JSON object at the end (tokens, text, finish reason, usage, timings).
    #[arg(long)]
    json: bool,
    /// Continue this W3C trace (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`): the
    /// request's spans join it when the mesh exports spans.
    #[arg(long, value_parser = parse_traceparent)]
    traceparent: Option<String>,
}

fn parse_traceparent(s: &str) -> Result<String, String> {
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit());
    let ok = parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2);
    if ok {
        Ok(s.to_ascii_lowercase())
    } else {
        Err("expected 00-<32 hex digits, not all 0>-<16 hex digits, not all 0>-<2 hex digits>"
            .into())
    }
}

pub fn request_of(a: &GenerateArgs) -> GenerateRequest {
    let input = if a.raw {
        generate_request::Input::Prompt(a.prompt.clone())
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        messages.push(ChatMessage { role: "user".into(), content: a.prompt.clone() });
        generate_request::Input::Chat(Chat { messages })
    };
    GenerateRequest {
        input: Some(input),
        max_tokens: a.max_tokens,
        sampling: Some(SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            seed: Some(a.seed),
            ..Default::default()
        }),
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        kv_policy: a.kv_policy.map(|p| p.to_string()).unwrap_or_default(),
        request_id: String::new(),
        model: a.model.clone().unwrap_or_default(),
    }
}

pub fn run(a: GenerateArgs, tls: &pdmesh_cli::client::TlsFlags) -> anyhow::Result<()> {
    let found = tls.init_client(&a.target)?;
    let key = pdmesh_cli::client::api_key(a.api_key.clone(), found.as_deref())?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(generate(a, key))
}

async fn generate(a: GenerateArgs, key: Option<String>) -> anyhow::Result<()> {
    let mut client = pdmesh_cli::client::connect(&a.target, key.as_deref()).await?;
    let mut req = tonic::Request::new(request_of(&a));
    req.set_timeout(Duration::from_secs(a.timeout_s));
    if let Some(tp) = &a.traceparent {
        let v = tp.parse().context("traceparent is not a valid header value")?;
        req.metadata_mut().insert("traceparent", v);
    }
    let mut stream = client.generate(req).await.map_err(status_err)?.into_inner();
    let mut out = std::io::stdout().lock();
    let (mut text, mut tokens) = (String::new(), Vec::new());
    let (mut request_id, mut trace_id) = (String::new(), String::new());
    while let Some(msg) = stream.message().await.map_err(status_err)? {
        match msg.event {
            Some(generate_response::Event::Started(s)) => {
                request_id = s.request_id;
                trace_id = s.trace_id;
            }
            Some(generate_response::Event::Delta(d)) => {
                tokens.extend_from_slice(&d.token_ids);
                text.push_str(&d.text);
                if !a.json && (out.write_all(d.text.as_bytes()).is_err() || out.flush().is_err()) {
                    return Ok(()); // stdout closed: dropping the stream cancels the request
                }
            }
            Some(generate_response::Event::Finished(f)) => {
                let reason = FinishReason::try_from(f.reason).unwrap_or(FinishReason::Unspecified);
                let reason =
                    reason.as_str_name().trim_start_matches("FINISH_REASON_").to_lowercase();
                let usage = f.usage.unwrap_or_default();
                let t = f.timings.unwrap_or_default();
                if a.json {
                    let j = serde_json::json!({
                        "request_id": request_id,
                        "trace_id": trace_id,
                        "text": text,
                        "tokens": tokens,
                        "finish_reason": reason,
                        "usage": {
                            "prompt_tokens": usage.prompt_tokens,
                            "cached_tokens": usage.cached_tokens,
                            "completion_tokens": usage.completion_tokens,
                            "kv_policy": usage.kv_policy,
                            "kv_evicted_tokens": usage.kv_evicted_tokens,
                        },
                        "timings": {
                            "queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms,
                            "transfer_ms": t.transfer_ms, "ttft_ms": t.ttft_ms, "total_ms": t.total_ms,
                            "prefill_node": t.prefill_node, "decode_node": t.decode_node,
                            "kv_transport": t.kv_transport, "kv_bytes": t.kv_bytes, "attempts": t.attempts, "migrations": t.migrations, "preemptions": t.preemptions,
                        },
                    });
                    writeln!(out, "{j}")?;
                } else {
                    writeln!(out)?;
                    eprintln!(
                        "[{reason}: {} prompt + {} generated tokens; ttft {:.1} ms (prefill {:.1} on {}, transfer {:.1} via {}), total {:.1} ms, decode on {}]",
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        t.ttft_ms,
                        t.prefill_ms,
                        t.prefill_node,
                        t.transfer_ms,
                        t.kv_transport,
                        t.total_ms,
                        t.decode_node
                    );
                    if !usage.kv_policy.is_empty() {
                        eprintln!(
                            "[KV policy {}: {} tokens of KV evicted]",
                            usage.kv_policy, usage.kv_evicted_tokens
                        );
                    }
                    if !trace_id.is_empty() {
                        eprintln!("[trace {trace_id}]");
                    }
                }
                return Ok(());
            }
            None => {}
        }
    }
    bail!("the stream ended without a finish message")
}

/// A status as an error that keeps its code.
pub fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

#[cfg(test)]
mod tests {
    use super::parse_traceparent;

    #[test]
    fn traceparents_are_checked() {
        let ok = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01";
        assert_eq!(parse_traceparent(ok).as_deref(), Ok(&*ok.to_ascii_lowercase()));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_err(), "{bad:?} accepted");
        }
    }
}
