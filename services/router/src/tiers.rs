//! Tiered routing: a request for the virtual model `auto` runs on the router's ladder of
//! models (`[tiers]`), cheapest first, by one of two policies. The classifier's choice is made
//! before the request is prepared (`Router::tier_models`): a ladder of one, which answers,
//! streaming. In a cascade each model but the last answers in full, out of the client's sight; its answer is kept
//! when its confidence — the mean log-probability of its tokens — reaches the threshold, and
//! is otherwise dropped for a run on the next model. The last model's answer streams to the
//! client as it comes. Either way the client sees one `Started`, one answer and a `Finished`
//! naming the model that gave it and how many times it escalated.

use std::time::Instant;

use pdmesh_common::apikey::Tenant;
use pdmesh_common::convert::ms;
use pdmesh_model::FinishReason;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::api::Event;
use crate::error::RequestError;
use crate::mesh::Mesh;
use crate::request::Prepared;

type Out = mpsc::Sender<Result<Event, RequestError>>;

/// Runs `ladder` (the request prepared for each model of the ladder, in order, each by its own
/// tokenizer and template) as a cascade, sending the kept answer to `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    mesh: &Mesh,
    id: String,
    ladder: Vec<Prepared>,
    min_mean_logprob: f32,
    tenant: &Tenant,
    deadline: Instant,
    out: Out,
    cancel: CancellationToken,
) {
    let t0 = Instant::now();
    let last = ladder.len().saturating_sub(1);
    let mut escalations = 0;
    for (k, prep) in ladder.into_iter().enumerate() {
        let (model, asked) = (prep.model.clone(), prep.sampling.logprobs);
        if k == last {
            let offset = ms(t0.elapsed());
            let (tx, mut rx) = mpsc::channel(32);
            let run = crate::relay::run(mesh, id, prep, tenant, deadline, tx, cancel);
            // Streams as it comes; a client gone drops `rx`, which the run takes for its leaving.
            let forward = async move {
                while let Some(mut e) = rx.recv().await {
                    if let Ok(Event::Finished(f)) = &mut e {
                        // The client waited for the earlier models too.
                        f.timings.ttft_ms += offset;
                        f.timings.total_ms += offset;
                        f.timings.escalations = escalations;
                    }
                    if out.send(e).await.is_err() {
                        return;
                    }
                }
            };
            tokio::join!(run, forward);
            return;
        }
        // Confidence needs each token's log-probability, asked for or not.
        let mut judged = prep;
        judged.sampling.logprobs = Some(asked.unwrap_or(0));
        let (tx, mut rx) = mpsc::channel(32);
        let run = crate::relay::run(mesh, id.clone(), judged, tenant, deadline, tx, cancel.clone());
        let collect = async {
            let mut events = Vec::new();
            while let Some(e) = rx.recv().await {
                events.push(e);
            }
            events
        };
        // A client that leaves while an earlier model answers ends the request: dropping the
        // run drops its streams, which aborts it on its nodes.
        let events = tokio::select! {
            ((), events) = async { tokio::join!(run, collect) } => events,
            () = out.closed() => {
                mesh.metrics.abandoned(&model);
                return;
            }
        };
        let confidence = mean_logprob(&events);
        let finished = events
            .iter()
            .any(|e| matches!(e, Ok(Event::Finished(f)) if f.reason != FinishReason::Cancelled));
        // A model that could not answer (no node of it up) passes the request on too.
        let unavailable = events.iter().any(|e| matches!(e, Err(RequestError::Unavailable(_))));
        if (finished && confidence < min_mean_logprob) || unavailable {
            tracing::info!(request = id, model, confidence, "escalating to the next model");
            mesh.metrics.escalated(&model);
            escalations += 1;
            continue;
        }
        for mut e in events {
            if let Ok(ev) = &mut e {
                keep_asked(ev, asked);
                if let Event::Finished(f) = ev {
                    // Nothing reached the client before the answer was whole.
                    f.timings.ttft_ms = ms(t0.elapsed());
                    f.timings.total_ms = ms(t0.elapsed());
                    f.timings.escalations = escalations;
                }
            }
            if out.send(e).await.is_err() {
                return;
            }
        }
        return;
    }
}

/// The mean log-probability of an answer's tokens; an empty answer has none, and is never
/// confident.
fn mean_logprob(events: &[Result<Event, RequestError>]) -> f32 {
    let lps: Vec<f32> = events
        .iter()
        .filter_map(|e| match e {
            Ok(Event::Delta { logprobs, .. }) => Some(logprobs.iter().map(|l| l.logprob)),
            _ => None,
        })
        .flatten()
        .collect();
    if lps.is_empty() {
        return f32::NEG_INFINITY;
    }
    lps.iter().sum::<f32>() / lps.len() as f32
}

/// Log-probabilities as the client asked for them: none unless it did.
fn keep_asked(e: &mut Event, asked: Option<u32>) {
    if let Event::Delta { logprobs, .. } = e
        && asked.is_none()
    {
        logprobs.clear();
    }
}
