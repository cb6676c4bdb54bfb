//! One attempt at a request on the nodes placement chose: reserve its KV on the decode node,
//! have the prefill node compute it (or the decode node, colocated) and push its KV, then
//! relay the decode node's stream. Each step has its file (`reserve`, `prefill`, `stream`);
//! this one runs them in order. Each step returns a typed `Failure`; whether to try again
//! elsewhere is decided once, by the caller, from it. Every wait is bounded by the request's
//! deadline, its cancellation, its client, and the nodes it runs on: one that leaves the mesh
//! fails the attempt at once, through its cancellation token.

use std::collections::VecDeque;
use std::future::Future;
use std::time::{Duration, Instant};

use pdmesh_common::convert::ms;
use pdmesh_common::trace;
use pdmesh_model::TokenLogprobs;
use pdmesh_proto::v1::decode_client::DecodeClient;
use pdmesh_proto::v1::prefill_client::PrefillClient;
use pdmesh_proto::v1::{
    DecodeRequest, HandOffRequest, KvTarget, PrefillRequest, ReleaseRequest, ReserveRequest, Role,
    decode_event, decode_request, prefill_event,
};
use pdmesh_wire::{logprobs_from_wire, sampler_state};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::{Instrument, Span};

use crate::api::{Event, Timings};
use crate::coalesce::Coalesce;
use crate::config::RouterConfig;
use pdmesh_kv_types::BlockHash;

use crate::error::RequestError;
use crate::mesh::Mesh;
use crate::placement::{Ask, blocks_needed, place};
use crate::registry::Node;
use crate::request::Prepared;

mod failure;
mod prefill;
mod reserve;
mod stream;

pub(crate) use failure::{Failure, Phase, failure_text};
use reserve::Reservation;
pub(crate) use reserve::up_front;
use stream::{Leg, Relayed};

/// What every attempt of one request shares.
pub(crate) struct Request<'a> {
    pub mesh: &'a Mesh,
    /// The pool of the request's model: where it is placed, queued and moved.
    pub pool: &'a crate::pool::Pool,
    pub id: &'a str,
    pub prep: &'a Prepared,
    /// The tenant it runs for: what a cancel names, with its id.
    pub owner: &'a str,
    /// The tenant's prefix-cache space.
    pub salt: [u8; 16],
    /// The prompt's block chain, hashed once.
    pub chain: crate::index::ChainCache,
    pub deadline: Instant,
    pub t0: Instant,
    pub out: &'a mpsc::Sender<Result<Event, RequestError>>,
    pub cancel: &'a CancellationToken,
}

impl Request<'_> {
    /// The prompt's chain under `layout`.
    pub(crate) fn chain(&self, layout: &pdmesh_kv_types::KvLayout) -> std::sync::Arc<[BlockHash]> {
        self.chain.get(layout, &self.salt, &self.prep.prompt)
    }

    /// Sends an event to the client, which gets `client_stall_ms` to make room: one that
    /// reads nothing for that long has stopped reading (an SSE client that never consumes
    /// its stream), and is treated as gone rather than holding its place and its KV until
    /// the deadline.
    pub(crate) async fn to_client(&self, ev: Result<Event, RequestError>) -> Result<(), Failure> {
        let most = Duration::from_millis(self.mesh.config.client_stall_ms);
        match tokio::time::timeout(most, self.out.send(ev)).await {
            Ok(sent) => sent.map_err(|_| Failure::Abandoned),
            Err(_) => {
                tracing::warn!(request = self.id, "the client read nothing for {most:?}; ended");
                Err(Failure::Abandoned)
            }
        }
    }
}

/// What the request has learned so far: its timings, and where its stream stands.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub timings: Timings,
    /// Prompt tokens the prefill node took from the prefix cache, and from which tiers.
    pub cached_tokens: u32,
    pub cached_by_tier: Option<pdmesh_proto::v1::CachedTokens>,
    pub first_sent: bool,
    /// Where the client's stream stands: what a migrated request continues from.
    pub resume: Resume,
    /// Logprob reports (when asked for) of tokens generated but not yet sent in a delta, in
    /// order: text lags tokens, so a report waits here until its token's text goes out.
    pub logprobs: VecDeque<TokenLogprobs>,
    /// Leading the computation of its prompt's new blocks: held until they are computed.
    pub leading: Option<crate::coalesce::Lead>,
    /// KV tokens the request's lossy policy evicted on the node that finished it.
    pub kv_evicted_tokens: u32,
}

impl Report {
    /// A delta for the client, with the reports of its tokens.
    pub fn delta(&mut self, text: String, tokens: Vec<u32>) -> Event {
        let n = tokens.len().min(self.logprobs.len());
        Event::Delta { text, tokens, logprobs: self.logprobs.drain(..n).collect() }
    }
}

/// Every token generated up to the last output the client was sent (text can lag them), and
/// the sampler's random stream after them: with the prompt, all a decode node needs to
/// continue the request exactly there.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Resume {
    pub tokens: Vec<u32>,
    pub rng_position: u128,
}

/// How decoding ended: the decode node's finish.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub reason: pdmesh_model::FinishReason,
    pub completion_tokens: u32,
}

/// Undoes the router-side load accounting of a node when its part of the attempt ends.
struct Assigned<'a> {
    mesh: &'a Mesh,
    node: String,
    tokens: u64,
}

impl<'a> Assigned<'a> {
    /// `blocks` reserved on a decode node, or `tokens` of prompt for a prefill node to compute.
    fn new(mesh: &'a Mesh, node: &Node, blocks: u32, tokens: u64) -> Self {
        mesh.registry().assign(&node.id, blocks, tokens);
        Self { mesh, node: node.id.clone(), tokens }
    }
}

impl Drop for Assigned<'_> {
    fn drop(&mut self) {
        self.mesh.registry().unassign(&self.node, self.tokens);
    }
}

fn with_timeout<T>(msg: T, until: Instant) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)));
    r
}

/// One attempt on a decode node and, unless colocated, a prefill node.
pub(crate) struct Attempt<'a> {
    pub req: &'a Request<'a>,
    pub report: &'a mut Report,
    pub decode: Node,
    pub prefill: Option<Node>,
    /// Blocks the decode node was counted for.
    pub blocks: u32,
    /// Prompt tokens the prefill node is expected to compute (the index's hits left out).
    pub prefill_tokens: u32,
}

impl<'a> Attempt<'a> {
    /// Waits for `fut`, or fails when the deadline passes (in `phase` on `node`), the request
    /// is cancelled, its client leaves, or one of `watched` leaves the mesh.
    async fn bounded<T>(
        &self,
        phase: Phase,
        node: &Node,
        watched: &[&Node],
        fut: impl Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        tokio::select! {
            // What a node already sent counts, even if it left since: relayed first, a moved
            // stream resumes as late as it can (and a reply that is there is not discarded).
            biased;
            r = fut => r,
            () = tokio::time::sleep_until(self.req.deadline.into()) => {
                Err(Failure::Deadline { phase, node: Some(node.id.clone()) })
            }
            () = self.req.cancel.cancelled() => Err(Failure::Cancelled),
            () = self.req.out.closed() => Err(Failure::Abandoned),
            gone = first_to_leave(watched) => Err(Failure::lost(
                &gone,
                "left the mesh (deregistered, or its heartbeats stopped)",
            )),
        }
    }

    /// Runs the attempt to the decode node's finish.
    pub async fn run(mut self) -> Result<Decoded, Failure> {
        let mesh = self.req.mesh;
        let decode = self.decode.clone();
        let assigned = Assigned::new(mesh, &decode, self.blocks, 0);
        let client = DecodeClient::new(channel(mesh, &decode)?);
        self.report.timings.decode_node = decode.id.clone();
        // A retry starts over: what an earlier attempt took from the cache is not what this one
        // does. A moved stream keeps the account of its prompt.
        if !self.report.first_sent {
            self.report.cached_tokens = 0;
            self.report.cached_by_tier = None;
        }
        let prep = self.req.prep;
        let resumed = self.report.resume.tokens.len();
        let up = up_front(&mesh.config, prep.max_tokens, resumed);
        let ask = (prep.prompt.len(), prep.max_tokens, up);
        let reservation = self.reserve(&client, &decode, ask, self.prefill.is_some()).await?;
        let (start, rng_position) = match self.prefill.clone() {
            Some(p) => {
                let p = self.coalesce(p, reservation.lapses).await?;
                self.prefill(&p, &reservation.target).await?
            }
            None => {
                self.report.timings.prefill_node = "colocated".into();
                self.report.timings.kv_transport = "local".into();
                (decode_request::Start::PrefillLocally(true), 0)
            }
        };
        let mut leg =
            Leg { node: decode, client, reservation, start, rng_position, _assigned: assigned };
        loop {
            match self.relay(leg).await? {
                Relayed::Finished(d) => return Ok(d),
                Relayed::Moved(next) => leg = *next,
            }
        }
    }
}

/// The shared channel to `node`.
fn channel(mesh: &Mesh, node: &Node) -> Result<trace::Channel, Failure> {
    mesh.channel(&node.address, node.role)
        .map_err(|e| Failure::lost(&node.id, format!("bad address {}: {e}", node.address)))
}

/// The id of the first of `watched` (a request's one or two nodes) to leave the mesh.
async fn first_to_leave(watched: &[&Node]) -> String {
    debug_assert!(watched.len() <= 2, "a request runs on at most two nodes");
    let leaves = |i: usize| async move {
        match watched.get(i) {
            Some(n) => {
                n.left.cancelled().await;
                n.id.clone()
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        id = leaves(0) => id,
        id = leaves(1) => id,
    }
}
