//! The KV layout handshake: which model, dtype, block size and shape a block of KV has.

use pdmesh_proto::v1::KvLayout;
use tonic::Status;

/// The layout of an engine's KV pool.
pub fn layout_of(engine: &pdmesh_engine::Engine) -> KvLayout {
    let g = engine.kv().geometry();
    KvLayout {
        model_fingerprint: engine.model().fingerprint,
        dtype: g.dtype.name().to_string(),
        block_size: g.block_size as u32,
        layers: g.layers as u32,
        kv_heads: g.kv_heads as u32,
        head_dim: g.head_dim as u32,
    }
}

/// Names every field on which `theirs` differs from `ours`, or None when they agree.
pub fn layout_mismatch(ours: &KvLayout, theirs: &KvLayout) -> Option<String> {
    let mut diffs = Vec::new();
    if ours.model_fingerprint != theirs.model_fingerprint {
        diffs.push(format!(
            "model fingerprint {:016x} vs {:016x}",
            ours.model_fingerprint, theirs.model_fingerprint
        ));
    }
    if ours.dtype != theirs.dtype {
        diffs.push(format!("dtype {} vs {}", ours.dtype, theirs.dtype));
    }
    let fields = [
        ("block_size", ours.block_size, theirs.block_size),
        ("layers", ours.layers, theirs.layers),
        ("kv_heads", ours.kv_heads, theirs.kv_heads),
        ("head_dim", ours.head_dim, theirs.head_dim),
    ];
    for (name, a, b) in fields {
        if a != b {
            diffs.push(format!("{name} {a} vs {b}"));
        }
    }
    (!diffs.is_empty()).then(|| diffs.join(", "))
}

/// FAILED_PRECONDITION naming the differences when `theirs` (from `peer`) is not `ours`.
pub fn check_layout(ours: &KvLayout, theirs: Option<&KvLayout>, peer: &str) -> Result<(), Status> {
    let Some(theirs) = theirs else {
        return Err(Status::invalid_argument(format!("{peer} sent no KV layout")));
    };
    match layout_mismatch(ours, theirs) {
        None => Ok(()),
        Some(d) => Err(Status::failed_precondition(format!(
            "KV layout mismatch with {peer} (ours vs theirs): {d}"
        ))),
    }
}

/// Bytes in one block of `layout`, or None if the layout is malformed.
pub fn bytes_per_block(layout: &KvLayout) -> Option<usize> {
    let elem = match layout.dtype.as_str() {
        "f16" => 2usize,
        "f32" => 4,
        _ => return None,
    };
    [layout.block_size, layout.layers, layout.kv_heads, layout.head_dim, 2]
        .iter()
        .try_fold(elem, |acc, &x| acc.checked_mul(x as usize))
        .filter(|&b| b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm() -> KvLayout {
        KvLayout {
            model_fingerprint: 0xabc,
            dtype: "f16".into(),
            block_size: 16,
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
        }
    }

    #[test]
    fn equal_layouts_pass_and_every_difference_is_named() {
        assert_eq!(layout_mismatch(&smollm(), &smollm()), None);
        let other = KvLayout { dtype: "f32".into(), block_size: 32, ..smollm() };
        let m = layout_mismatch(&smollm(), &other).expect("differs");
        assert!(m.contains("dtype f16 vs f32") && m.contains("block_size 16 vs 32"), "{m}");
        let s = check_layout(&smollm(), Some(&other), "prefill-1").expect_err("refused");
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        assert!(s.message().contains("prefill-1"));
        let fp = KvLayout { model_fingerprint: 1, ..smollm() };
        assert!(layout_mismatch(&smollm(), &fp).expect("differs").contains("fingerprint"));
        assert_eq!(
            check_layout(&smollm(), None, "x").expect_err("missing").code(),
            tonic::Code::InvalidArgument
        );
    }

    #[test]
    fn block_bytes_match_the_engine_ledger() {
        // 16 tokens x 30 layers x (K+V) x 3 heads x 64 dims x 2 bytes = 360 KiB (368,640 B).
        assert_eq!(bytes_per_block(&smollm()), Some(368_640));
        assert_eq!(bytes_per_block(&KvLayout { dtype: "q4".into(), ..smollm() }), None);
        assert_eq!(bytes_per_block(&KvLayout { layers: 0, ..smollm() }), None);
    }
}
