//! The KV layout handshake on the wire: every field of `pdmesh_kv_types::KvLayout`, the dtype
//! by name. Reading one checks it, so a peer's malformed layout is an error that says why,
//! never a layout that merely fails to compare equal.

use pdmesh_kv_types::{KvGeometry, KvLayout};

use crate::v1;

impl From<&KvLayout> for v1::KvLayout {
    fn from(l: &KvLayout) -> Self {
        let g = &l.geometry;
        v1::KvLayout {
            model_fingerprint: l.model_fingerprint,
            dtype: g.dtype.name().to_string(),
            block_size: g.block_size as u32,
            layers: g.layers as u32,
            kv_heads: g.kv_heads as u32,
            head_dim: g.head_dim as u32,
        }
    }
}

impl From<KvLayout> for v1::KvLayout {
    fn from(l: KvLayout) -> Self {
        (&l).into()
    }
}

/// A layout from the wire, checked: a known dtype and non-zero dimensions.
pub fn layout_from_wire(w: &v1::KvLayout) -> Result<KvLayout, String> {
    let l = KvLayout {
        model_fingerprint: w.model_fingerprint,
        geometry: KvGeometry {
            dtype: w.dtype.parse()?,
            block_size: w.block_size as usize,
            layers: w.layers as usize,
            kv_heads: w.kv_heads as usize,
            head_dim: w.head_dim as usize,
        },
    };
    l.validate()?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_kv_types::KvDtype;

    #[test]
    fn layouts_round_trip_and_bad_ones_say_why() {
        let l = KvLayout {
            model_fingerprint: 0xfeed,
            geometry: KvGeometry {
                dtype: KvDtype::F32,
                block_size: 16,
                layers: 30,
                kv_heads: 3,
                head_dim: 64,
            },
        };
        let w = v1::KvLayout::from(&l);
        assert_eq!(layout_from_wire(&w), Ok(l));
        let bad = v1::KvLayout { dtype: "q4".into(), ..w.clone() };
        assert!(layout_from_wire(&bad).expect_err("dtype").contains("q4"));
        let bad = v1::KvLayout { head_dim: 0, ..w };
        assert!(layout_from_wire(&bad).expect_err("head_dim").contains("head_dim"));
        for dtype in [KvDtype::Q8_0, KvDtype::Q8_0NoRot] {
            let q = KvLayout { geometry: KvGeometry { dtype, ..l.geometry }, ..l };
            let w = v1::KvLayout::from(&q);
            assert_eq!(w.dtype, dtype.name());
            assert_eq!(layout_from_wire(&w), Ok(q));
        }
    }
}
