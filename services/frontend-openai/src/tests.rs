//! The API's checks and error mapping on the tiny model: what each bad value gets, and what a
//! good request becomes.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use http::StatusCode;
use pdmesh_model::testing::tiny_card;
use pdmesh_router::RequestError;
use serde_json::json;

use crate::error::ApiError;
use crate::handlers::parse_body;
use crate::prepare::{self, Plan};
use crate::schema::{ChatCompletionRequest, CommonParams, CompletionRequest};

const ID: &str = "tiny";

fn chat(body: serde_json::Value) -> Result<Plan, ApiError> {
    let bytes = serde_json::to_vec(&body).unwrap();
    let r: ChatCompletionRequest = parse_body(&bytes)?;
    let c: CommonParams = parse_body(&bytes)?;
    prepare::chat(&tiny_card(), ID, &r, &c)
}

fn completion(body: serde_json::Value) -> Result<Plan, ApiError> {
    let bytes = serde_json::to_vec(&body).unwrap();
    let r: CompletionRequest = parse_body(&bytes)?;
    let c: CommonParams = parse_body(&bytes)?;
    prepare::completion(&tiny_card(), ID, &r, &c)
}

fn user(extra: serde_json::Value) -> serde_json::Value {
    let mut b = json!({"model": ID, "messages": [{"role": "user", "content": "hi there"}]});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

#[test]
fn a_good_chat_request_becomes_the_routers_request() {
    let p = chat(user(json!({
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": -3,
        "stop": "x",
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "logprobs": true,
        "top_logprobs": 4,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "ignore_eos": true,
        "kv_policy": "h2o:512",
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": "u-1",
        "some_future_field": {"a": 1},
    })))
    .unwrap();
    // The newer name wins.
    assert_eq!(p.prep.max_tokens, 7);
    let s = &p.prep.sampling;
    assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (0.5, 0.9, 20, 0.05));
    assert_eq!((s.frequency_penalty, s.presence_penalty), (0.5, -0.5));
    assert_eq!(s.seed, (-3i64) as u64);
    assert_eq!((s.logprobs, p.logprobs), (Some(4), Some(4)));
    assert_eq!(p.prep.stop, ["x"]);
    assert!(p.prep.ignore_eos && p.stream && p.include_usage);
    assert_eq!(p.prep.kv_policy.map(|k| k.to_string()).as_deref(), Some("h2o:512:256"));
    assert_eq!(p.user.as_deref(), Some("u-1"));
    // The prompt is the chat template's rendering; defaults fill the rest of the context.
    let d = chat(user(json!({}))).unwrap();
    assert_eq!(d.prep.prompt, p.prep.prompt);
    assert_eq!(d.prep.max_tokens + d.prep.prompt.len(), tiny_card().config.context);
    assert_eq!(d.prep.sampling.temperature, 1.0);
    assert!(d.prep.sampling.logprobs.is_none() && !d.stream && !d.include_usage);
    // Text parts are the same message as a string; `developer` is the system role.
    let parts = chat(json!({"model": ID, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
    ]}))
    .unwrap();
    let plain = chat(json!({"model": ID, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]}))
    .unwrap();
    assert_eq!(parts.prep.prompt, plain.prep.prompt);
}

#[test]
fn completions_take_text_or_ids_and_default_to_16_tokens() {
    let t = completion(json!({"model": ID, "prompt": "hello"})).unwrap();
    assert_eq!(t.prep.max_tokens, 16);
    let one = completion(json!({"model": ID, "prompt": ["hello"]})).unwrap();
    assert_eq!(one.prep.prompt, t.prep.prompt);
    let ids = completion(json!({"model": ID, "prompt": [5, 6, 7], "logprobs": 2})).unwrap();
    assert_eq!((ids.prep.prompt.clone(), ids.logprobs), (vec![5, 6, 7], Some(2)));
    let batch = completion(json!({"model": ID, "prompt": [[5, 6]]})).unwrap();
    assert_eq!(batch.prep.prompt, [5, 6]);
}

/// Each bad value: a 400 naming the parameter (or a 404 for the model).
#[test]
fn every_bad_value_names_its_parameter() {
    let cases = [
        (user(json!({"temperature": 2.5})), "temperature"),
        (user(json!({"temperature": "hot"})), "temperature"),
        (user(json!({"top_p": 0})), "top_p"),
        (user(json!({"n": 3})), "n"),
        (user(json!({"max_tokens": 0})), "max_tokens"),
        (user(json!({"max_tokens": -1})), "max_tokens"),
        (user(json!({"max_completion_tokens": 100000})), "max_completion_tokens"),
        (user(json!({"frequency_penalty": -2.5})), "frequency_penalty"),
        (user(json!({"presence_penalty": 9})), "presence_penalty"),
        (user(json!({"top_logprobs": 3})), "top_logprobs"),
        (user(json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs"),
        (user(json!({"top_k": -5})), "top_k"),
        (user(json!({"min_p": 1.5})), "min_p"),
        (user(json!({"repetition_penalty": 0})), "repetition_penalty"),
        (user(json!({"stop": [""]})), "stop"),
        (user(json!({"stream_options": {"include_usage": true}})), "stream_options"),
        (user(json!({"logit_bias": {"5": 10}})), "logit_bias"),
        (user(json!({"tools": [{"type": "function"}]})), "tools"),
        (user(json!({"response_format": {"type": "json_object"}})), "response_format"),
        (user(json!({"seed": "x"})), "seed"),
        (user(json!({"kv_policy": "lru:64"})), "kv_policy"),
        (user(json!({"kv_policy": "sinks:0"})), "kv_policy"),
        (json!({"model": ID, "messages": []}), "messages"),
        (
            json!({"model": ID, "messages": [{"role": "wizard", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"model": ID, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content[0].type",
        ),
        (json!({"model": ID, "messages": [{"role": 5, "content": "x"}]}), "messages[0].role"),
        (json!({"model": ID}), "messages"),
    ];
    for (body, param) in cases {
        let e = chat(body.clone()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}: {e:?}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        assert!(e.message.contains(param), "{body}: {}", e.message);
    }
    let completions = [
        (json!({"model": ID, "prompt": ""}), "prompt"),
        (json!({"model": ID, "prompt": [999999]}), "prompt"),
        (json!({"model": ID, "prompt": ["a", "b"]}), "prompt"),
        (json!({"model": ID, "prompt": "a", "echo": true}), "echo"),
        (json!({"model": ID, "prompt": "a", "best_of": 2}), "best_of"),
        (json!({"model": ID, "prompt": "a", "logprobs": 50}), "logprobs"),
        (json!({"model": ID, "prompt": "a", "max_tokens": 1000}), "max_tokens"),
    ];
    for (body, param) in completions {
        let e = completion(body.clone()).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some(param)),
            "{body}"
        );
    }
    // An unknown `model` is the handler's 404 (it resolves the name before preparing):
    // `openai_sdk.py` and `two_models.py` ask for one through the SDK.
    let e = parse_body::<CommonParams>(b"{not json").unwrap_err();
    assert_eq!((e.status, e.param), (StatusCode::BAD_REQUEST, None));
}

#[test]
fn router_failures_map_to_the_apis_statuses() {
    let over = RequestError::Overloaded {
        message: "full".into(),
        retry_after: Duration::from_millis(1500),
    };
    let cases = [
        (RequestError::Invalid("x".into()), StatusCode::BAD_REQUEST),
        (over, StatusCode::TOO_MANY_REQUESTS),
        (RequestError::Duplicate("r".into()), StatusCode::CONFLICT),
        (RequestError::Unavailable("none".into()), StatusCode::SERVICE_UNAVAILABLE),
        (RequestError::Deadline("late".into()), StatusCode::GATEWAY_TIMEOUT),
        (RequestError::Node(tonic::Status::internal("boom")), StatusCode::INTERNAL_SERVER_ERROR),
        (
            RequestError::Node(pdmesh_common::status::exhausted("busy", Duration::from_secs(2))),
            StatusCode::TOO_MANY_REQUESTS,
        ),
    ];
    for (e, status) in cases {
        let api = ApiError::from(e.clone());
        assert_eq!(api.status, status, "{e:?}");
        let r = axum::response::IntoResponse::into_response(api);
        let retry =
            r.headers().get(http::header::RETRY_AFTER).map(|v| v.to_str().unwrap().to_string());
        // Whole seconds, rounded up, on every 429.
        match (status, &e) {
            (StatusCode::TOO_MANY_REQUESTS, RequestError::Overloaded { .. }) => {
                assert_eq!(retry.as_deref(), Some("2"))
            }
            (StatusCode::TOO_MANY_REQUESTS, _) => assert_eq!(retry.as_deref(), Some("2")),
            _ => assert_eq!(retry, None, "{e:?}"),
        }
    }
    let body = ApiError::invalid("top_p", "bad").body();
    let v = serde_json::to_value(body).unwrap();
    assert_eq!(
        v,
        json!({"error": {"message": "top_p: bad", "type": "invalid_request_error", "param": "top_p", "code": null}})
    );
}

/// `x-request-timeout: 1e20` is finite and positive, and past what a `Duration` holds:
/// `Duration::from_secs_f64` panicked on it, in the handler, before the key was checked. Now
/// any timeout past the router's bound is the router's bound.
#[test]
fn a_timeout_past_what_a_duration_holds_is_capped_not_a_panic() {
    use crate::handlers::{TIMEOUT_HEADER, deadline};
    let (now, most) = (std::time::Instant::now(), Duration::from_secs(600));
    let with = |v: &str| {
        let mut h = http::HeaderMap::new();
        h.insert(TIMEOUT_HEADER, v.parse().unwrap());
        deadline(most, &h, now)
    };
    for huge in ["1e20", "1.8e19", "1e308"] {
        assert_eq!(with(huge).unwrap(), now + most, "{huge}");
    }
    assert_eq!(with("2.5").unwrap(), now + Duration::from_millis(2500));
    for bad in ["0", "-1", "inf", "NaN", "soon"] {
        assert_eq!(with(bad).unwrap_err().status, StatusCode::BAD_REQUEST, "{bad}");
    }
    assert_eq!(deadline(most, &http::HeaderMap::new(), now).unwrap(), now + most);
}

/// A body is read within its bound: one announced too large is refused unread (413), one
/// that grows past the bound is cut off (413), and a good one arrives whole.
#[tokio::test]
async fn bodies_are_bounded_before_they_are_read() {
    use crate::handlers::{MAX_BODY_BYTES, read_body};
    let mut h = http::HeaderMap::new();
    h.insert(http::header::CONTENT_LENGTH, (MAX_BODY_BYTES + 1).to_string().parse().unwrap());
    let e = read_body(&h, axum::body::Body::empty()).await.unwrap_err();
    assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
    let big = axum::body::Body::from(vec![b' '; MAX_BODY_BYTES + 1]);
    let e = read_body(&http::HeaderMap::new(), big).await.unwrap_err();
    assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
    let ok = read_body(&http::HeaderMap::new(), axum::body::Body::from("{}")).await.unwrap();
    assert_eq!(&ok[..], b"{}");
}
