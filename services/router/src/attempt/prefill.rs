//! The attempt's prefill step: coalescing with a prefill already computing this prompt's
//! leading blocks, then the prefill node computing the prompt and pushing its KV into the
//! reservation.

use super::*;

impl Attempt<'_> {
    /// In-flight prefix coalescing (`coalesce.rs`), as the prompt is about to go to prefill
    /// node `p`: while another request's prefill computes leading blocks of this prompt that
    /// no prefill node held when it started, waits for it, then prefills on the node that
    /// computed them (they are in its cache) instead of `p`. Otherwise leads the blocks it
    /// computes itself (`report.leading`) for later prompts to wait on. The wait ends by
    /// `coalesce_wait_ms`, half of what is left of the deadline or of the reservation's lease.
    pub(super) async fn coalesce(
        &mut self,
        p: Node,
        lease_lapses: Instant,
    ) -> Result<Node, Failure> {
        let req = self.req;
        let mesh = req.mesh;
        // What an earlier attempt led is over: it must not wait on itself.
        self.report.leading = None;
        let wait = mesh.config.coalesce_wait_ms;
        if wait == 0 || !p.load.publishes {
            return Ok(p);
        }
        let t0 = Instant::now();
        let half = |until: Instant| until.saturating_duration_since(t0) / 2;
        let until =
            t0 + half(req.deadline).min(half(lease_lapses)).min(Duration::from_millis(wait));
        let mut on = p;
        let mut waited = false;
        loop {
            // The same exact index placement reads: blocks some prefill node can take from a
            // cache are not led, and not waited for.
            let c = (on.layout, req.chain(&on.layout));
            let held = {
                let reg = mesh.registry();
                let prefills = reg.live_refs(req.pool.fingerprint(), Role::Prefill, Instant::now());
                let hits = crate::relay::hits_of(mesh, req.prep.prompt.len(), &c, &prefills);
                hits.values().map(|h| h.total()).max().unwrap_or(0)
            };
            let next = mesh.computing.lead_or_follow(&on.layout, &c.1, held);
            let (mut leader, tokens) = match next {
                None => break,
                Some(Coalesce::Lead(l)) => {
                    self.report.leading = Some(l);
                    break;
                }
                Some(Coalesce::Follow { leader, tokens }) => (leader, tokens),
            };
            if Instant::now() >= until {
                break;
            }
            if !std::mem::replace(&mut waited, true) {
                mesh.metrics.coalesced();
                tracing::debug!(request = req.id, tokens, "waiting for a prefix being computed");
            }
            tokio::select! {
                _ = leader.changed() => {}
                () = tokio::time::sleep_until(until.into()) => break,
                () = req.cancel.cancelled() => return Err(Failure::Cancelled),
                () = req.out.closed() => return Err(Failure::Abandoned),
            }
            // Where the leader computed it: its own cache holds the blocks for certain.
            let computed_on = leader.borrow().clone();
            if let Some(n) = computed_on.and_then(|id| mesh.registry().get(&id).cloned())
                && n.load.cache_blocks > 0
                && !n.load.draining
            {
                on = n;
            }
        }
        if waited {
            trace::attr(&Span::current(), "coalesce_wait_ms", ms(t0.elapsed()));
        }
        Ok(on)
    }

    /// Has the prefill node compute the prompt and push its KV into the reservation; returns
    /// how decoding starts (the first token and the sampler's position).
    pub(super) async fn prefill(
        &mut self,
        p: &Node,
        target: &KvTarget,
    ) -> Result<(decode_request::Start, u128), Failure> {
        let req = self.req;
        let cfg = &req.mesh.config;
        // The prefill node's share ends with its part (the KV is complete), not the request's.
        let _assigned = Assigned::new(req.mesh, p, 0, u64::from(self.prefill_tokens));
        // A moved stream's prompt is prefilled as it was the first time (and its first token
        // sampled again); the decode node recomputes the rest as it was first computed.
        let chain = req.chain(&p.layout);
        req.mesh.index.sent(&p.id, &chain, p.load.cache_blocks as usize);
        self.report.timings.prefill_node = p.id.clone();
        let mut client = PrefillClient::new(channel(req.mesh, p)?);
        let msg = PrefillRequest {
            request_id: req.id.to_string(),
            prompt: req.prep.prompt.clone(),
            sampler: Some(sampler_state(&req.prep.sampling, 0)),
            cache_salt: bytes::Bytes::copy_from_slice(&req.salt),
            target: Some(target.clone()),
        };
        let queued_at_router = req.t0.elapsed();
        if !self.report.first_sent {
            req.mesh.metrics.dispatched(queued_at_router.as_secs_f64());
        }
        let watched = [p, &self.decode];
        // The prefill node losing the decode node is the decode node's failure: the retry
        // must avoid it, not the prefill node.
        let d = &self.decode.id;
        let fail = |s: &Status| match pdmesh_common::status::lost_peer(s) {
            Some(lost) if lost == d => Failure::lost(d, s.message()),
            _ => Failure::from_node(&p.id, s),
        };
        let opened =
            async { client.prefill(with_timeout(msg, req.deadline)).await.map_err(|s| fail(&s)) };
        let mut events = self.bounded(Phase::Prefilling, p, &watched, opened).await?.into_inner();
        let first = async {
            match events.message().await.map_err(|s| fail(&s))? {
                Some(pdmesh_proto::v1::PrefillEvent {
                    event: Some(prefill_event::Event::Computed(c)),
                }) => Ok(c),
                _ => Err(Failure::lost(&p.id, "prefill stream ended before the first token")),
            }
        };
        let computed = self.bounded(Phase::Prefilling, p, &watched, first).await?;
        // The prompt is in the node's cache: those waiting for its blocks may go there.
        if let Some(l) = self.report.leading.take() {
            l.computed_on(&p.id);
        }
        if !self.report.first_sent {
            let t = &mut self.report.timings;
            t.queue_ms = ms(queued_at_router) + computed.queue_ms;
            t.prefill_ms = computed.prefill_ms;
            self.report.cached_tokens = computed.cached_tokens;
            self.report.cached_by_tier = computed.cached_by_tier;
        }
        let until =
            req.deadline.min(Instant::now() + Duration::from_millis(cfg.transfer_timeout_ms));
        let transferred = async {
            let next = tokio::time::timeout_at(until.into(), events.message())
                .await
                .map_err(|_| Failure::lost(&p.id, "KV transfer did not complete in time"))?
                .map_err(|s| fail(&s))?;
            match next {
                Some(pdmesh_proto::v1::PrefillEvent {
                    event: Some(prefill_event::Event::Transferred(t)),
                }) => Ok(t),
                _ => Err(Failure::lost(&p.id, "prefill stream ended before the KV was complete")),
            }
        };
        let t = self.bounded(Phase::Transferring, p, &watched, transferred).await?;
        let timings = &mut self.report.timings;
        timings.transfer_ms = t.transfer_ms;
        timings.kv_bytes = t.bytes;
        timings.kv_transport = t.transport;
        // The first token's report; a moved stream's first token went out long ago.
        if self.report.resume.tokens.is_empty() {
            self.report.logprobs.clear();
            self.report.logprobs.extend(computed.logprobs.as_ref().map(logprobs_from_wire));
        }
        let pos = pdmesh_wire::rng_position(&computed.rng_position).map_err(|s| fail(&s))?;
        Ok((decode_request::Start::FirstToken(computed.first_token), pos))
    }
}
