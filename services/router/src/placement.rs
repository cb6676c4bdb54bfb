//! Placement: which decode node reserves a request's KV and which prefill node computes it. A
//! pure function over a snapshot of the nodes, so policies can be tested and compared without
//! a network. Load-aware for now; the prefix-aware policy joins with the KV-store.

use pdmesh_proto::v1::Role;

use crate::registry::Node;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// Prompts shorter than this stay on the decode node (0 = never).
    pub colocate_below: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub decode: String,
    /// None: the decode node prefills the prompt itself.
    pub prefill: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error("no decode node is registered")]
    NoDecodeNode,
    #[error("no decode node has {need} free KV blocks (most free: {best})")]
    NoCapacity { need: usize, best: usize },
}

fn free_blocks(n: &Node) -> usize {
    n.load.free_blocks.saturating_sub(n.pending_blocks) as usize
}

/// Blocks a request needs on its decode node, for the node's block size.
pub fn blocks_needed(n: &Node, ask: &Ask) -> usize {
    (ask.prompt_tokens + ask.max_tokens).div_ceil(n.layout.block_size.max(1) as usize)
}

/// Picks nodes for `ask`, never one in `exclude` (nodes that already failed this request).
pub fn place(
    prefill: &[Node],
    decode: &[Node],
    ask: &Ask,
    exclude: &[String],
) -> Result<Placement, PlaceError> {
    let usable = |n: &&Node| !exclude.contains(&n.id);
    let decodes: Vec<&Node> =
        decode.iter().filter(|n| n.role == Role::Decode).filter(usable).collect();
    if decodes.is_empty() {
        return Err(PlaceError::NoDecodeNode);
    }
    // Among decode nodes with room, the least busy relative to its size; ties by free blocks.
    let fits: Vec<&&Node> =
        decodes.iter().filter(|n| free_blocks(n) >= blocks_needed(n, ask)).collect();
    let Some(d) = fits.into_iter().min_by(|a, b| {
        let score = |n: &Node| {
            let running = f64::from(n.load.running + n.load.queued + n.assigned);
            let used = 1.0 - free_blocks(n) as f64 / f64::from(n.load.total_blocks.max(1));
            running + used
        };
        score(a)
            .total_cmp(&score(b))
            .then(free_blocks(b).cmp(&free_blocks(a)))
            .then(a.id.cmp(&b.id))
    }) else {
        let need = decodes.iter().map(|n| blocks_needed(n, ask)).min().unwrap_or(0);
        let best = decodes.iter().map(|n| free_blocks(n)).max().unwrap_or(0);
        return Err(PlaceError::NoCapacity { need, best });
    };
    let colocate = ask.prompt_tokens < ask.colocate_below;
    let p = if colocate {
        None
    } else {
        prefill
            .iter()
            .filter(|n| n.role == Role::Prefill)
            .filter(usable)
            .min_by_key(|n| (n.load.queued + n.load.running + n.assigned, n.id.clone()))
            .map(|n| n.id.clone())
    };
    Ok(Placement { decode: d.id.clone(), prefill: p })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_proto::v1::{KvLayout, NodeLoad};
    use std::time::Instant;

    fn node(id: &str, role: Role, free: u32, running: u32) -> Node {
        Node {
            id: id.into(),
            role,
            address: String::new(),
            layout: KvLayout { block_size: 16, ..Default::default() },
            load: NodeLoad { free_blocks: free, total_blocks: 100, running, ..Default::default() },
            last_seen: Instant::now(),
            assigned: 0,
            pending_blocks: 0,
            suspect_until: None,
        }
    }

    fn ask(prompt: usize) -> Ask {
        Ask { prompt_tokens: prompt, max_tokens: 16, colocate_below: 0 }
    }

    #[test]
    fn picks_least_loaded_nodes_with_room() {
        let d = [
            node("d1", Role::Decode, 100, 5),
            node("d2", Role::Decode, 100, 1),
            node("d3", Role::Decode, 1, 0),
        ];
        let p = [node("p1", Role::Prefill, 100, 3), node("p2", Role::Prefill, 100, 0)];
        let got = place(&p, &d, &ask(100), &[]).unwrap();
        assert_eq!(got, Placement { decode: "d2".into(), prefill: Some("p2".into()) });
    }

    #[test]
    fn router_side_assignments_count_before_heartbeats_do() {
        let mut d = [node("d1", Role::Decode, 100, 0), node("d2", Role::Decode, 100, 0)];
        d[0].assigned = 2;
        assert_eq!(place(&[], &d, &ask(10), &[]).unwrap().decode, "d2");
        d[1].pending_blocks = 95;
        assert_eq!(place(&[], &d, &ask(100), &[]).unwrap().decode, "d1", "d2 has no room left");
    }

    #[test]
    fn colocates_without_prefill_nodes_or_below_threshold() {
        let d = [node("d1", Role::Decode, 100, 0)];
        let p = [node("p1", Role::Prefill, 100, 0)];
        assert_eq!(place(&[], &d, &ask(10), &[]).unwrap().prefill, None);
        let short = Ask { colocate_below: 64, ..ask(10) };
        assert_eq!(place(&p, &d, &short, &[]).unwrap().prefill, None);
        let long = Ask { colocate_below: 64, ..ask(100) };
        assert_eq!(place(&p, &d, &long, &[]).unwrap().prefill, Some("p1".into()));
    }

    #[test]
    fn excluded_nodes_are_never_chosen() {
        let d = [node("d1", Role::Decode, 100, 0), node("d2", Role::Decode, 100, 9)];
        let p = [node("p1", Role::Prefill, 100, 0), node("p2", Role::Prefill, 100, 9)];
        let got = place(&p, &d, &ask(10), &["d1".into(), "p1".into()]).unwrap();
        assert_eq!(got, Placement { decode: "d2".into(), prefill: Some("p2".into()) });
        assert_eq!(
            place(&p, &d, &ask(10), &["d1".into(), "d2".into()]),
            Err(PlaceError::NoDecodeNode)
        );
    }

    #[test]
    fn no_room_anywhere_is_capacity_exhausted() {
        let d = [node("d1", Role::Decode, 3, 0)];
        assert_eq!(
            place(&[], &d, &ask(100), &[]),
            Err(PlaceError::NoCapacity { need: 8, best: 3 })
        );
        assert_eq!(place(&[], &[], &ask(1), &[]), Err(PlaceError::NoDecodeNode));
    }
}
