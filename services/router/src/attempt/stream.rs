//! The attempt's last step: the decode node's stream relayed to the client, and a draining
//! node's request handed off to another decode node with its KV.

use super::*;

impl<'a> Attempt<'a> {
    /// Attaches to the leg's reservation and relays its node's stream to the client until it
    /// finishes, or until the node, draining, handed the request off to the next leg.
    pub(super) async fn relay(&mut self, mut leg: Leg<'a>) -> Result<Relayed<'a>, Failure> {
        let req = self.req;
        let d = leg.node.clone();
        let fail = |s: &Status| Failure::from_node(&d.id, s);
        let resume = &self.report.resume;
        // A moved stream's sampler continues from where its last node's stood.
        let rng = if resume.tokens.is_empty() { leg.rng_position } else { resume.rng_position };
        // A node that prefills the prompt itself sends nothing until its whole prompt is
        // computed, however long that takes (minutes for a long prompt on a slow node), as a
        // prefill node does: its stream counts as silent only from its first message on.
        let mut prefilling = matches!(leg.start, decode_request::Start::PrefillLocally(true));
        let msg = DecodeRequest {
            reservation_id: leg.reservation.target.reservation_id.clone(),
            prompt: req.prep.prompt.clone(),
            sampler: Some(sampler_state(&req.prep.sampling, rng)),
            max_tokens: req.prep.max_tokens as u32,
            stop: req.prep.stop.clone(),
            ignore_eos: req.prep.ignore_eos,
            start: Some(leg.start),
            resumed: resume.tokens.clone(),
            kv_policy: req.prep.kv_policy.map(|p| p.to_string()).unwrap_or_default(),
        };
        let mut client = leg.client.clone();
        let opened =
            async { client.decode(with_timeout(msg, req.deadline)).await.map_err(|s| fail(&s)) };
        let mut stream = self.bounded(Phase::Decoding, &d, &[&d], opened).await?.into_inner();
        // The stream owns the reservation now: dropping it cancels the request on the node.
        leg.reservation.armed = false;
        let stall = Duration::from_millis(req.mesh.config.stall_timeout_ms);
        // The text flushed as the request ends goes out with its finish: if the node dies in
        // between, the node the request moves to flushes it again.
        let mut tail: Option<pdmesh_proto::v1::Delta> = None;
        // Where the request goes once its node says it moved.
        let mut next: Option<Leg<'a>> = None;
        loop {
            // Past the deadline `bounded` ends it, whatever the stall bound.
            let bound = if prefilling {
                self.req.deadline.saturating_duration_since(Instant::now())
            } else {
                stall
            };
            let message = async {
                tokio::time::timeout(bound, stream.message())
                    .await
                    .map_err(|_| Failure::lost(&d.id, format!("no token for {stall:?}")))?
                    .map_err(|s| fail(&s))?
                    .ok_or_else(|| Failure::lost(&d.id, "decode stream ended without a finish"))
            };
            let ev = self.bounded(Phase::Decoding, &d, &[&d], message).await?;
            prefilling = false;
            if let Some(mark) = &ev.mark {
                let rng = pdmesh_wire::rng_position(&mark.rng_position).map_err(|s| fail(&s))?;
                self.report.resume.rng_position = rng;
            }
            let marked = ev.mark.map(|m| {
                self.report.logprobs.extend(m.logprobs.iter().map(logprobs_from_wire));
                m.tokens
            });
            match ev.event {
                Some(decode_event::Event::Delta(delta)) => {
                    let Some(tokens) = marked else {
                        tail = Some(delta);
                        continue;
                    };
                    let out = self.report.delta(delta.text, delta.token_ids);
                    if !self.report.first_sent {
                        self.report.first_sent = true;
                        self.report.timings.ttft_ms = ms(req.t0.elapsed());
                    }
                    self.send(&d, out).await?;
                    self.report.resume.tokens.extend(tokens);
                }
                Some(decode_event::Event::Moving(m)) => {
                    self.report.resume.tokens.extend(marked.unwrap_or_default());
                    match self.hand_off(&leg, m.kv_tokens as usize).await {
                        Ok(to) => next = Some(to),
                        Err(why) => {
                            tracing::warn!(request = req.id, node = d.id, "not moved: {why}");
                            self.stay(&leg).await;
                        }
                    }
                }
                Some(decode_event::Event::Moved(_)) => {
                    let to = next.take().ok_or_else(|| {
                        Failure::lost(&d.id, "ended the stream as moved, but nothing took it")
                    })?;
                    return Ok(Relayed::Moved(Box::new(to)));
                }
                Some(decode_event::Event::Finished(f)) => {
                    if let Some(t) = tail.take() {
                        let out = self.report.delta(t.text, t.token_ids);
                        self.send(&d, out).await?;
                    }
                    if self.prefill.is_none() && self.report.timings.migrations == 0 {
                        self.report.timings.queue_ms = f.queue_ms;
                        self.report.timings.prefill_ms = f.prefill_ms;
                    }
                    self.report.kv_evicted_tokens = f.kv_evicted_tokens;
                    return Ok(Relayed::Finished(Decoded {
                        reason: pdmesh_wire::finish_from(f.reason),
                        completion_tokens: f.completion_tokens,
                    }));
                }
                None => return Err(fail(&Status::internal("empty decode event"))),
            }
        }
    }

    /// The node of `from` is draining: finds another decode node with room, reserves the
    /// request's KV there, and has `from`'s node push it (`HandOff`). The request then goes on
    /// there from its last token, nothing recomputed. On failure the caller lets it stay.
    pub(super) async fn hand_off(
        &mut self,
        from: &Leg<'a>,
        kv_tokens: usize,
    ) -> Result<Leg<'a>, String> {
        let (req, mesh) = (self.req, self.req.mesh);
        let cfg = &mesh.config;
        let generated = self.report.resume.tokens.len();
        if generated == 0 || kv_tokens + 1 != req.prep.prompt.len() + generated {
            return Err(format!("it holds {kv_tokens} tokens of KV after {generated} generated"));
        }
        // The tokens it holds KV for, and the rest of the request's output but the last.
        let ask = Ask {
            prompt_tokens: kv_tokens,
            max_tokens: req.prep.max_tokens + 1 - generated,
            up_front: up_front(cfg, req.prep.max_tokens + 1 - generated, 0),
            colocate_below: 0,
            colocate_when_prefill_busy: 0,
            policy: cfg.prefill_policy,
            turn: mesh.next_turn(),
            seed: fastrand::u64(..),
            hits: Default::default(),
            store_cost: cfg.kvstore_read_cost,
            max_imbalance: cfg.prefix_max_imbalance,
        };
        let others = std::slice::from_ref(&from.node.id);
        // As placement does: in the registry, under its lock, copying only the node chosen.
        let node = {
            let reg = mesh.registry();
            let decodes = reg.live_refs(req.pool.fingerprint(), Role::Decode, Instant::now());
            let placed = place(&[], &decodes, &ask, others).map_err(|e| e.to_string())?;
            reg.get(&placed.decode).cloned().ok_or("the node chosen left the mesh")?
        };
        let assigned = Assigned::new(mesh, &node, blocks_needed(&node, &ask) as u32, 0);
        let client = DecodeClient::new(channel(mesh, &node).map_err(|f| failure_text(&f))?);
        let reservation = self
            .reserve(&client, &node, (ask.prompt_tokens, ask.max_tokens, ask.up_front), true)
            .await
            .map_err(|f| failure_text(&f))?;
        let until =
            req.deadline.min(Instant::now() + Duration::from_millis(cfg.transfer_timeout_ms));
        let call = HandOffRequest {
            reservation_id: from.reservation.target.reservation_id.clone(),
            target: Some(reservation.target.clone()),
        };
        let mut c = from.client.clone();
        let pushed = async {
            let r = c.hand_off(with_timeout(call, until)).await;
            r.map_err(|s| Failure::from_node(&from.node.id, &s))
        };
        let done = self
            .bounded(Phase::Transferring, &from.node, &[&from.node, &node], pushed)
            .await
            .map_err(|f| failure_text(&f))?
            .into_inner();
        let t = &mut self.report.timings;
        t.migrations += 1;
        t.decode_node = node.id.clone();
        mesh.metrics.migrated();
        tracing::info!(
            request = req.id,
            from = from.node.id,
            to = node.id,
            bytes = done.bytes,
            transport = done.transport,
            transfer_ms = done.transfer_ms,
            "moved with its KV"
        );
        let start = decode_request::Start::HandedOff(true);
        Ok(Leg { node, client, reservation, start, rng_position: 0, _assigned: assigned })
    }

    /// Tells a draining node to keep the request it asked to move (best effort: if the node
    /// cannot be told, its stream fails and the request moves by recomputing).
    pub(super) async fn stay(&self, leg: &Leg<'_>) {
        let call = HandOffRequest {
            reservation_id: leg.reservation.target.reservation_id.clone(),
            target: None,
        };
        let cfg = &self.req.mesh.config;
        let until = Instant::now() + Duration::from_millis(cfg.node_call_timeout_ms);
        if let Err(s) = leg.client.clone().hand_off(with_timeout(call, until)).await {
            tracing::warn!(node = leg.node.id, "could not keep the request there: {}", s.message());
        }
    }
}

/// One decode node's part of an attempt: the reservation it runs the request in, how the
/// request starts there, and the node's share of the router's load accounting.
pub(super) struct Leg<'a> {
    pub(super) node: Node,
    pub(super) client: DecodeClient<trace::Channel>,
    pub(super) reservation: Reservation,
    pub(super) start: decode_request::Start,
    /// Where the prefill node's sampler stood after the first token.
    pub(super) rng_position: u128,
    pub(super) _assigned: Assigned<'a>,
}

/// How a leg ended.
pub(super) enum Relayed<'a> {
    Finished(Decoded),
    /// Its node handed the request off: it goes on in this leg.
    Moved(Box<Leg<'a>>),
}

impl Attempt<'_> {
    /// Sends an event to the client, waiting for room while the node `d` stays.
    pub(super) async fn send(&self, d: &Node, ev: Event) -> Result<(), Failure> {
        self.bounded(Phase::Decoding, d, &[d], self.req.to_client(Ok(ev))).await
    }
}
