//! Workload traces in the Mooncake format (`../shared/traces/README.md`): one JSON object a
//! line with `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, the prompt's
//! prefix blocks of `TRACE_BLOCK_TOKENS` tokens (equal ids at the same position mean the two
//! prompts share that block and every block before it). Parsing, and the ideal hit rate: the
//! share of prompt tokens an unbounded prefix cache would serve, the ceiling any cache and
//! placement policy is measured against.

use std::collections::HashSet;
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
            let full = (r.input_length / TRACE_BLOCK_TOKENS) as usize;
            let hit = r.hash_ids.iter().take(full).take_while(|id| seen.contains(id)).count();
            seen.extend(r.hash_ids.iter().copied());
            hit as u64 * TRACE_BLOCK_TOKENS
        })
        .collect()
}

/// The share of all prompt tokens `ideal_hits` serves.
pub fn ideal_hit_rate(trace: &[TraceRequest]) -> f64 {
    let total: u64 = trace.iter().map(|r| r.input_length).sum();
    if total == 0 {
        return 0.0;
    }
    ideal_hits(trace).iter().sum::<u64>() as f64 / total as f64
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
