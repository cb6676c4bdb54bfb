//! The KV layout handshake on the wire: every field of `pdmesh_kv_types::KvLayout`, the dtype
//! by name. Reading one checks it, so a peer's malformed layout is an error that says why,
//! never a layout that merely fails to compare equal.

use pdmesh_kv_types::{KvGeometry, KvLayout, KvWindow, LayerMask, MAX_WINDOW_LAYERS};

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
            window_tokens: l.window.map_or(0, |w| w.tokens as u32),
            window_layers: l
                .window
                .map_or(Vec::new(), |w| w.local.layers().map(|l| l as u32).collect()),
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
        window: window_from_wire(w)?,
    };
    l.validate()?;
    Ok(l)
}

fn window_from_wire(w: &v1::KvLayout) -> Result<Option<KvWindow>, String> {
    if w.window_tokens == 0 {
        if !w.window_layers.is_empty() {
            return Err("KV layout: window layers without a window".into());
        }
        return Ok(None);
    }
    let local = LayerMask::from_layers(w.window_layers.iter().map(|&l| l as usize))
        .ok_or_else(|| format!("KV layout: a window layer is past {MAX_WINDOW_LAYERS}"))?;
    if local.count() == 0 {
        return Err("KV layout: a window on no layer".into());
    }
    Ok(Some(KvWindow { tokens: w.window_tokens as usize, local }))
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
            window: None,
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

    /// A window round-trips; one that names layers past the model, windows every layer, has
    /// layers but no tokens, or names a layer past the mask is refused with its reason.
    #[test]
    fn windows_round_trip_and_bad_ones_say_why() {
        let local = LayerMask::from_layers([0, 1, 2, 4]).unwrap();
        let l = KvLayout {
            model_fingerprint: 1,
            geometry: KvGeometry {
                dtype: KvDtype::F16,
                block_size: 16,
                layers: 6,
                kv_heads: 1,
                head_dim: 64,
            },
            window: Some(KvWindow { tokens: 512, local }),
        };
        let w = v1::KvLayout::from(&l);
        assert_eq!((w.window_tokens, &w.window_layers[..]), (512, &[0, 1, 2, 4][..]));
        assert_eq!(layout_from_wire(&w), Ok(l));
        let past = v1::KvLayout { window_layers: vec![0, 6], ..w.clone() };
        assert!(layout_from_wire(&past).expect_err("past").contains("layer 6"));
        let every = v1::KvLayout { window_layers: (0..6).collect(), ..w.clone() };
        assert!(layout_from_wire(&every).expect_err("every").contains("every layer"));
        let no_tokens = v1::KvLayout { window_tokens: 0, ..w.clone() };
        assert!(layout_from_wire(&no_tokens).expect_err("tokens").contains("without a window"));
        let huge = v1::KvLayout { window_layers: vec![1 << 20], ..w.clone() };
        assert!(layout_from_wire(&huge).expect_err("mask").contains("past 256"));
        assert!(l.mismatch(&KvLayout { window: None, ..l }).expect("differs").contains("window"));
    }
}
