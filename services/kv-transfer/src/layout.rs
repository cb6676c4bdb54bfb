//! The KV layout handshake as both ends of a transfer check it: a peer's layout (from the wire)
//! against ours. A mismatch is FAILED_PRECONDITION naming every difference, never silently
//! wrong output.

use pdmesh_kv_types::KvLayout;
use pdmesh_proto::v1;
use tonic::Status;

/// FAILED_PRECONDITION naming the differences when `theirs` (from `peer`) is not `ours`;
/// INVALID_ARGUMENT when it is missing or malformed.
pub fn check_layout(
    ours: &KvLayout,
    theirs: Option<&v1::KvLayout>,
    peer: &str,
) -> Result<(), Status> {
    let Some(theirs) = theirs else {
        return Err(Status::invalid_argument(format!("{peer} sent no KV layout")));
    };
    let theirs = pdmesh_proto::layout_from_wire(theirs)
        .map_err(|e| Status::invalid_argument(format!("{peer} sent a malformed {e}")))?;
    match ours.mismatch(&theirs) {
        None => Ok(()),
        Some(d) => Err(Status::failed_precondition(format!(
            "KV layout mismatch with {peer} (ours vs theirs): {d}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_kv_types::{KvDtype, KvGeometry};

    fn smollm() -> KvLayout {
        KvLayout {
            model_fingerprint: 0xabc,
            geometry: KvGeometry {
                dtype: KvDtype::F16,
                block_size: 16,
                layers: 30,
                kv_heads: 3,
                head_dim: 64,
            },
            window: None,
        }
    }

    #[test]
    fn a_different_layout_is_a_failed_precondition_naming_the_peer() {
        assert!(check_layout(&smollm(), Some(&smollm().into()), "x").is_ok());
        let other = v1::KvLayout { dtype: "f32".into(), block_size: 32, ..smollm().into() };
        let s = check_layout(&smollm(), Some(&other), "prefill-1").expect_err("refused");
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        assert!(s.message().contains("prefill-1") && s.message().contains("dtype f16 vs f32"));
        assert_eq!(
            check_layout(&smollm(), None, "x").expect_err("missing").code(),
            tonic::Code::InvalidArgument
        );
        let bad = v1::KvLayout { dtype: "q4".into(), ..smollm().into() };
        let s = check_layout(&smollm(), Some(&bad), "x").expect_err("malformed");
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn q8_0_blocks_never_meet_f16_or_unrotated_ones() {
        let q8 =
            |dtype| KvLayout { geometry: KvGeometry { dtype, ..smollm().geometry }, ..smollm() };
        let ours = q8(KvDtype::Q8_0);
        assert!(check_layout(&ours, Some(&ours.into()), "x").is_ok());
        for (theirs, says) in
            [(smollm(), "dtype q8_0 vs f16"), (q8(KvDtype::Q8_0NoRot), "q8_0 vs q8_0-norot")]
        {
            let s = check_layout(&ours, Some(&theirs.into()), "decode-0").expect_err("refused");
            assert_eq!(s.code(), tonic::Code::FailedPrecondition);
            assert!(s.message().contains(says), "{}", s.message());
        }
        // A q8_0 layout whose heads do not split into 32-value blocks is malformed.
        let bad = v1::KvLayout { head_dim: 80, ..ours.into() };
        let s = check_layout(&ours, Some(&bad), "x").expect_err("malformed");
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(s.message().contains("head_dim 80"), "{}", s.message());
    }
}
