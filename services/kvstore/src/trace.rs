//! Workload traces in the Mooncake format (`../shared/traces/README.md`): one JSON object a
//! line with `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, the prompt's
//! prefix blocks of `TRACE_BLOCK_TOKENS` tokens (equal ids at the same position mean the two
//! prompts share that block and every block before it). Parsing, and the ideal hit rate: the
//! share of prompt tokens an unbounded prefix cache would serve, the ceiling any cache and
//! placement policy is measured against.

use std::collections::{HashMap, HashSet};
use std::io::BufRead;

use serde::Deserialize;

/// Tokens per `hash_ids` block in the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The ids of its full blocks, the only ones a cache shares (a partial last block's KV
    /// never is). `read_trace` checked there is an id for every block.
    pub fn full_blocks(&self) -> &[u64] {
        let full = (self.input_length / TRACE_BLOCK_TOKENS) as usize;
        &self.hash_ids[..full.min(self.hash_ids.len())]
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    #[error("trace line {line}: {why}")]
    Bad { line: usize, why: String },
}

/// Reads up to `limit` requests (all with `None`), checking each line.
pub fn read_trace(r: impl BufRead, limit: Option<usize>) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in r.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| TraceError::Bad { line: i + 1, why };
        let req: TraceRequest = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        let blocks = req.input_length.div_ceil(TRACE_BLOCK_TOKENS);
        if req.hash_ids.len() as u64 != blocks {
            return Err(bad(format!(
                "{} hash_ids for {} input tokens ({blocks} blocks of {TRACE_BLOCK_TOKENS})",
                req.hash_ids.len(),
                req.input_length
            )));
        }
        if let Some(prev) = out.last().map(|p: &TraceRequest| p.timestamp)
            && req.timestamp < prev
        {
            return Err(bad(format!("timestamp {} is before the previous {prev}", req.timestamp)));
        }
        out.push(req);
    }
    Ok(out)
}

/// Tokens an unbounded cache serves to each request in arrival order: its leading blocks
/// seen in any earlier request. Only full blocks are served (a partial last block's KV is
/// never shared), matching how the mesh caches.
pub fn ideal_hits(trace: &[TraceRequest]) -> Vec<u64> {
    let mut seen: HashSet<u64> = HashSet::new();
    trace
        .iter()
        .map(|r| {
            let hit = r.full_blocks().iter().take_while(|id| seen.contains(id)).count();
            seen.extend(r.hash_ids.iter().copied());
            hit as u64 * TRACE_BLOCK_TOKENS
        })
        .collect()
}

/// Tokens a cache shared by every node could have served each request when it was sent: its
/// leading blocks that an earlier request had finished computing by then. `sent_s[i]` is when
/// request `i` was sent and `computed_s[i]` when its prompt's KV existed (`None`: it failed).
/// The gap to `ideal_hits` is prefixes still being computed when a request needing them came,
/// which only waiting for them recovers; the gap from here to the hits achieved is placement's.
pub fn reachable_hits(
    trace: &[TraceRequest],
    sent_s: &[f64],
    computed_s: &[Option<f64>],
) -> Vec<u64> {
    let mut ready: HashMap<u64, f64> = HashMap::new();
    trace
        .iter()
        .zip(sent_s.iter().zip(computed_s))
        .map(|(r, (&at, &done))| {
            let hit = r
                .full_blocks()
                .iter()
                .take_while(|id| ready.get(id).is_some_and(|&t| t <= at))
                .count();
            if let Some(done) = done {
                for id in &r.hash_ids {
                    let t = ready.entry(*id).or_insert(done);
                    *t = t.min(done);
                }
            }
            hit as u64 * TRACE_BLOCK_TOKENS
        })
        .collect()
}

/// For each request, the earlier request it is the next turn of, if any: the latest one whose
/// full blocks (at least two, so a shared system prompt alone makes no conversation) all lead
/// its prompt. Its prompt holds that turn's answer, so it cannot have been sent before it.
pub fn previous_turns(trace: &[TraceRequest]) -> Vec<Option<usize>> {
    let mut by_blocks: HashMap<&[u64], usize> = HashMap::new();
    trace
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let previous =
                (2..=r.hash_ids.len()).rev().find_map(|n| by_blocks.get(&r.hash_ids[..n]).copied());
            let full = r.full_blocks();
            if full.len() >= 2 {
                by_blocks.insert(full, i);
            }
            previous
        })
        .collect()
}

/// The share of all prompt tokens `ideal_hits` serves.
pub fn ideal_hit_rate(trace: &[TraceRequest]) -> f64 {
    share_of_prompts(trace, &ideal_hits(trace))
}

/// The share of all of `trace`'s prompt tokens that `hits` (tokens per request) are.
pub fn share_of_prompts(trace: &[TraceRequest], hits: &[u64]) -> f64 {
    let total: u64 = trace.iter().map(|r| r.input_length).sum();
    if total == 0 {
        return 0.0;
    }
    hits.iter().sum::<u64>() as f64 / total as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ts: u64, input: u64, ids: &[u64]) -> String {
        format!(
            r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 5, "hash_ids": {ids:?}}}"#
        )
    }

    #[test]
    fn ideal_hits_count_leading_full_blocks_seen_before() {
        let text = [
            req(0, 1100, &[0, 1, 3]), // 2 full blocks + 76 tokens
            req(5, 1536, &[0, 1, 2]), // shares 0 and 1: 1024 tokens
            req(9, 1024, &[0, 7]),    // shares 0 only (7 is new)
            req(9, 1000, &[0, 1]),    // block 1 is its partial tail: only 0 counts
            req(12, 512, &[4]),       // nothing
        ]
        .join("\n");
        let t = read_trace(text.as_bytes(), None).unwrap();
        assert_eq!(ideal_hits(&t), vec![0, 1024, 512, 512, 0]);
        let total = 1100 + 1536 + 1024 + 1000 + 512;
        assert!((ideal_hit_rate(&t) - 2048.0 / total as f64).abs() < 1e-12);
        assert_eq!(read_trace(text.as_bytes(), Some(2)).unwrap().len(), 2);
    }

    #[test]
    fn reachable_hits_need_the_prefix_computed_before_the_request_came() {
        let text = [
            req(0, 1024, &[0, 1]),
            req(1, 1024, &[0, 1]), // came while the first was computing: nothing
            req(5, 1536, &[0, 1, 2]), // both blocks computed by t=3
            req(6, 1024, &[5, 6]), // nothing shared
            req(7, 1024, &[5, 6]), // its only source failed
        ]
        .join("\n");
        let t = read_trace(text.as_bytes(), None).unwrap();
        let sent = [0.0, 1.0, 5.0, 6.0, 7.0];
        let computed = [Some(3.0), Some(2.0), Some(9.0), None, Some(8.0)];
        assert_eq!(reachable_hits(&t, &sent, &computed), vec![0, 0, 1024, 0, 0]);
        assert_eq!(ideal_hits(&t), vec![0, 1024, 1024, 0, 1024]);
    }

    #[test]
    fn a_turn_follows_the_latest_request_whose_full_blocks_lead_it() {
        let text = [
            req(0, 1100, &[0, 1, 2]),    // full blocks 0, 1
            req(1, 2000, &[0, 1, 3, 4]), // next turn of the first
            req(2, 1600, &[0, 1, 3, 5]), // of the second? its full blocks are 0, 1, 3: yes
            req(3, 600, &[0, 9]),        // one full block: leads nothing
            req(4, 1024, &[0, 9]),       // a shared first block alone is no conversation
            req(5, 1024, &[0, 1]),       // the third's blocks 0, 1, 3 don't lead it; the first's do
        ]
        .join("\n");
        let t = read_trace(text.as_bytes(), None).unwrap();
        assert_eq!(previous_turns(&t), vec![None, Some(0), Some(1), None, None, Some(0)]);
    }

    #[test]
    fn bad_lines_are_refused_with_their_number() {
        let wrong_blocks = [req(0, 600, &[0])].join("\n");
        let e = read_trace(wrong_blocks.as_bytes(), None).unwrap_err();
        assert!(e.to_string().contains("line 1") && e.to_string().contains("hash_ids"), "{e}");
        let backwards = [req(5, 10, &[0]), req(4, 10, &[1])].join("\n");
        let e = read_trace(backwards.as_bytes(), None).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        let e = read_trace("{not json".as_bytes(), None).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
    }
}
