//! The attempt's first step: KV blocks reserved on the decode node, released if the attempt
//! ends before a decode stream takes them over.

use super::*;

/// Output tokens a decode reservation promises up front (`RouterConfig::reserve_tokens`): the
/// `resumed` ones a moved or preempted stream recomputes there, and that many more; None (all
/// of `max_tokens`) when reservations do not grow.
pub(crate) fn up_front(cfg: &RouterConfig, max_tokens: usize, resumed: usize) -> Option<usize> {
    match cfg.reserve_tokens {
        0 => None,
        n => Some((resumed + n).min(max_tokens)),
    }
}

/// Releases a reservation on drop unless a decode stream took it over.
pub(super) struct Reservation {
    pub(super) client: DecodeClient<trace::Channel>,
    pub(super) target: KvTarget,
    /// When the node frees it by itself.
    pub(super) lapses: Instant,
    pub(super) armed: bool,
}

/// How long one Release may take, and the pause before it is sent again.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
const RELEASE_RETRY: Duration = Duration::from_secs(1);

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.armed {
            let mut c = self.client.clone();
            let (id, lapses) = (self.target.reservation_id.clone(), self.lapses);
            // A node that cannot be reached now (hung, cut off) is sent the release again until
            // it answers, so its blocks come back as soon as it does rather than at the lease's
            // end; a node that is gone took the reservation with it.
            let release = async move {
                loop {
                    let mut r = tonic::Request::new(ReleaseRequest { reservation_id: id.clone() });
                    r.set_timeout(RELEASE_TIMEOUT);
                    match c.release(r).await {
                        Ok(_) => return,
                        Err(s)
                            if !matches!(
                                s.code(),
                                Code::Unavailable | Code::DeadlineExceeded | Code::Unknown
                            ) =>
                        {
                            return;
                        }
                        Err(_) if Instant::now() + RELEASE_RETRY >= lapses => return,
                        Err(_) => tokio::time::sleep(RELEASE_RETRY).await,
                    }
                }
            };
            tokio::spawn(release.in_current_span());
        }
    }
}

impl Attempt<'_> {
    /// Reserves KV blocks on decode node `d` for `(prompt_tokens, max_tokens, up_front)`
    /// (`Ask`); with `remote_kv` the prompt's blocks are allocated for a transport to write
    /// into.
    pub(super) async fn reserve(
        &self,
        client: &DecodeClient<trace::Channel>,
        d: &Node,
        (prompt_tokens, max_tokens, up_front): (usize, usize, Option<usize>),
        remote_kv: bool,
    ) -> Result<Reservation, Failure> {
        let req = self.req;
        let cfg = &req.mesh.config;
        let until =
            req.deadline.min(Instant::now() + Duration::from_millis(cfg.node_call_timeout_ms));
        let msg = ReserveRequest {
            request_id: req.id.to_string(),
            prompt_tokens: prompt_tokens as u32,
            max_tokens: max_tokens as u32,
            lease_ms: cfg.lease_ms,
            remote_kv,
            owner: req.owner.to_string(),
            // Never 0 when growing: 0 asks for all of max_tokens.
            reserve_tokens: up_front.map_or(0, |u| u.max(1) as u32),
        };
        let mut c = client.clone();
        let call = async {
            let answer = tokio::time::timeout_at(until.into(), c.reserve(with_timeout(msg, until)))
                .await
                .map_err(|_| Failure::lost(&d.id, "no answer to Reserve in time"))?
                .map_err(|s| Failure::from_node(&d.id, &s))?;
            let answer = answer.into_inner();
            let lease = Duration::from_millis(u64::from(answer.lease_ms));
            let target = answer.target.ok_or_else(|| {
                Failure::from_node(&d.id, &Status::internal("Reserve answered without a target"))
            })?;
            Ok((target, lease))
        };
        let (target, lease) = self.bounded(Phase::Queued, d, &[d], call).await?;
        let lapses = Instant::now() + lease;
        Ok(Reservation { client: client.clone(), target, lapses, armed: true })
    }
}
