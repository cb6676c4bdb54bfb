//! The engine's request-level types on the wire: a sampler's parameters and where its random
//! stream stands (so a request sampled on one node continues on another), and why generation
//! ended. One conversion each way, so router, prefill and decode agree; `common` stays free
//! of the engine.

use pdmesh_model::{FinishReason as EngineFinish, SamplingParams, TokenLogprobs};
use pdmesh_proto::v1::{self as w, FinishReason, SamplerState};
use tonic::Status;

/// The wire form of a sampler: its parameters and where its random stream stands.
pub fn sampler_state(p: &SamplingParams, rng_position: u128) -> SamplerState {
    SamplerState {
        temperature: p.temperature,
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        penalty_window: p.penalty_window.min(u32::MAX as usize) as u32,
        seed: p.seed,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        logprobs: p.logprobs,
        rng_position: if rng_position == 0 {
            Default::default()
        } else {
            rng_position_bytes(rng_position)
        },
    }
}

/// Sampling parameters and random-stream position from the wire, checked.
pub fn sampling_from(s: Option<&SamplerState>) -> Result<(SamplingParams, u128), Status> {
    let s = s.ok_or_else(|| Status::invalid_argument("sampler is missing"))?;
    let p = SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        penalty_window: s.penalty_window as usize,
        seed: s.seed,
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        logprobs: s.logprobs,
    };
    p.validate().map_err(|e| Status::invalid_argument(format!("sampler: {e}")))?;
    Ok((p, rng_position(&s.rng_position)?))
}

/// A token's logprob report as the wire carries it.
pub fn logprobs_to_wire(l: &TokenLogprobs) -> w::TokenLogprobs {
    w::TokenLogprobs {
        token: l.token,
        logprob: l.logprob,
        top: l.top.iter().map(|&(token, logprob)| w::TopLogprob { token, logprob }).collect(),
    }
}

/// A token's logprob report from the wire.
pub fn logprobs_from_wire(l: &w::TokenLogprobs) -> TokenLogprobs {
    TokenLogprobs {
        token: l.token,
        logprob: l.logprob,
        top: l.top.iter().map(|t| (t.token, t.logprob)).collect(),
    }
}

/// Stop strings one request may have, and the bytes of each.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;

/// Checks a request's stop strings (the router does for clients, a decode node again for
/// whoever calls it: each is matched against the output at every token).
pub fn check_stops(stops: &[String]) -> Result<(), String> {
    if stops.len() > MAX_STOPS {
        return Err(format!("stop: at most {MAX_STOPS} stop strings, got {}", stops.len()));
    }
    for (i, st) in stops.iter().enumerate() {
        if st.is_empty() || st.len() > MAX_STOP_BYTES {
            return Err(format!(
                "stop[{i}]: must be 1 to {MAX_STOP_BYTES} bytes, got {}",
                st.len()
            ));
        }
    }
    Ok(())
}

/// A random-stream position from its little-endian bytes (empty = 0).
pub fn rng_position(b: &[u8]) -> Result<u128, Status> {
    match b.len() {
        0 => Ok(0),
        16 => Ok(u128::from_le_bytes(b.try_into().expect("length checked"))),
        n => Err(Status::invalid_argument(format!("rng_position must be 16 bytes, got {n}"))),
    }
}

pub fn rng_position_bytes(pos: u128) -> bytes::Bytes {
    pos.to_le_bytes().to_vec().into()
}

pub fn finish_reason(r: EngineFinish) -> FinishReason {
    match r {
        EngineFinish::Eos => FinishReason::Eos,
        EngineFinish::Stop => FinishReason::Stop,
        EngineFinish::Length | EngineFinish::ContextFull => FinishReason::Length,
        EngineFinish::Cancelled => FinishReason::Cancelled,
    }
}

/// A finish reason from the wire (an unknown one reads as `Stop`: generation ended by a rule).
pub fn finish_from(r: i32) -> EngineFinish {
    match FinishReason::try_from(r) {
        Ok(FinishReason::Eos) => EngineFinish::Eos,
        Ok(FinishReason::Length) => EngineFinish::Length,
        Ok(FinishReason::Cancelled) => EngineFinish::Cancelled,
        Ok(FinishReason::Stop | FinishReason::Unspecified) | Err(_) => EngineFinish::Stop,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sampler_round_trips() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            seed: 9,
            frequency_penalty: 0.5,
            presence_penalty: -0.25,
            logprobs: Some(3),
            ..Default::default()
        };
        let pos = (1u128 << 70) + 5;
        let s = sampler_state(&p, pos);
        assert_eq!(sampling_from(Some(&s)).unwrap(), (p.clone(), pos));
        assert_eq!(sampling_from(Some(&sampler_state(&p, 0))).unwrap().1, 0);
        let bad = SamplerState { top_p: 0.0, ..s.clone() };
        assert_eq!(sampling_from(Some(&bad)).unwrap_err().code(), tonic::Code::InvalidArgument);
        let bad = SamplerState { rng_position: vec![1, 2].into(), ..s };
        assert_eq!(sampling_from(Some(&bad)).unwrap_err().code(), tonic::Code::InvalidArgument);
        assert!(sampling_from(None).is_err());
        let l = TokenLogprobs { token: 4, logprob: -0.5, top: vec![(4, -0.5), (9, -1.5)] };
        assert_eq!(logprobs_from_wire(&logprobs_to_wire(&l)), l);
    }

    #[test]
    fn finish_reasons_round_trip() {
        for r in
            [EngineFinish::Eos, EngineFinish::Stop, EngineFinish::Length, EngineFinish::Cancelled]
        {
            assert_eq!(finish_from(finish_reason(r) as i32), r);
        }
        // The wire has no context-full: it is a length.
        assert_eq!(
            finish_from(finish_reason(EngineFinish::ContextFull) as i32),
            EngineFinish::Length
        );
    }
}
