//! Which part of a prompt's KV a continuation needs, for models whose local layers attend
//! through a sliding window: the next token's local layers read only the last `tokens`
//! positions, so a block wholly before that window is needed for its global layers alone.
//! Such a block travels *thin*: its global layers' parts, in layer order, and nothing else;
//! the blocks from the window on travel whole. Sender and receiver agree on the cut from the
//! layout (the window is part of the handshake) and the prompt's length, so nothing on the
//! wire says which blocks are thin.

use crate::KvLayout;

/// The most layers a window's layer mask describes; no sliding-window model comes near it.
pub const MAX_WINDOW_LAYERS: usize = 256;

/// The layers that attend through a window, as a bit set (`Copy`, so the layout stays so).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LayerMask([u64; MAX_WINDOW_LAYERS / 64]);

impl LayerMask {
    /// The mask of the layers for which `local[i]` holds; None past `MAX_WINDOW_LAYERS`.
    pub fn from_flags(local: &[bool]) -> Option<Self> {
        Self::from_layers(local.iter().enumerate().filter(|&(_, &l)| l).map(|(i, _)| i))
    }

    /// The mask of the named layers; None when one is past `MAX_WINDOW_LAYERS`.
    pub fn from_layers(layers: impl IntoIterator<Item = usize>) -> Option<Self> {
        let mut m = Self::default();
        for l in layers {
            *m.0.get_mut(l / 64)? |= 1 << (l % 64);
        }
        Some(m)
    }

    pub fn contains(&self, layer: usize) -> bool {
        self.0.get(layer / 64).is_some_and(|w| w >> (layer % 64) & 1 == 1)
    }

    /// The layers in the mask, in order.
    pub fn layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_WINDOW_LAYERS).filter(|&l| self.contains(l))
    }

    pub fn count(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// A model's sliding window as the KV layout states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvWindow {
    /// Positions a local layer's query attends to (its own included).
    pub tokens: usize,
    /// The local layers; the others attend to the whole prefix.
    pub local: LayerMask,
}

impl KvLayout {
    /// How many of the first blocks travel thin when a continuation follows `tokens` cached
    /// tokens: those whose last position is before the window of the token at `tokens`.
    /// Block `i` is thin when `(i + 1) * block_size <= tokens + 1 - window`, the rule by
    /// which a decode node lets a local layer's block go.
    pub fn thin_blocks(&self, tokens: usize) -> usize {
        match self.window {
            Some(w) => (tokens + 1).saturating_sub(w.tokens) / self.block_size(),
            None => 0,
        }
    }

    /// Bytes of block `index` on the wire when the first `thin` blocks travel thin.
    pub fn wire_block_bytes(&self, index: usize, thin: usize) -> usize {
        if index < thin {
            self.global_layers() * self.geometry.bytes_per_layer()
        } else {
            self.bytes_per_block()
        }
    }

    /// Bytes of blocks `first..end` on the wire when the first `thin` travel thin.
    pub fn wire_bytes(&self, first: usize, end: usize, thin: usize) -> usize {
        let end = end.max(first);
        let thin_part = thin.clamp(first, end) - first;
        thin_part * self.wire_block_bytes(0, 1) + (end - first - thin_part) * self.bytes_per_block()
    }

    /// Where layer `layer`'s part starts in block `index`'s wire form (thin before `thin`),
    /// or None when the block travels without it.
    pub fn wire_layer_offset(&self, layer: usize, index: usize, thin: usize) -> Option<usize> {
        let bpl = self.geometry.bytes_per_layer();
        match self.window {
            Some(w) if index < thin => (!w.local.contains(layer))
                .then(|| (0..layer).filter(|&l| !w.local.contains(l)).count() * bpl),
            _ => Some(layer * bpl),
        }
    }

    /// Layers a thin block carries: those without a window.
    pub fn global_layers(&self) -> usize {
        self.geometry.layers - self.window.map_or(0, |w| w.local.count())
    }

    /// Cuts `data`, the wire form of consecutive blocks from `first` (thin before `thin`), into
    /// its blocks; None unless it is whole blocks.
    pub fn split_wire<'d>(
        &self,
        first: usize,
        thin: usize,
        data: &'d [u8],
    ) -> Option<Vec<&'d [u8]>> {
        let mut out = Vec::new();
        let mut rest = data;
        while !rest.is_empty() {
            let n = self.wire_block_bytes(first + out.len(), thin);
            if n == 0 || rest.len() < n {
                return None;
            }
            let (block, tail) = rest.split_at(n);
            out.push(block);
            rest = tail;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvDtype, KvGeometry};

    /// Gemma 3 270M's shape: 18 layers, every sixth global, a 512-token window.
    fn gemma() -> KvLayout {
        let local = LayerMask::from_flags(&(0..18).map(|l| l % 6 != 5).collect::<Vec<_>>());
        KvLayout {
            model_fingerprint: 3,
            geometry: KvGeometry {
                layers: 18,
                kv_heads: 1,
                head_dim: 256,
                block_size: 16,
                dtype: KvDtype::F16,
            },
            window: Some(KvWindow { tokens: 512, local: local.unwrap() }),
        }
    }

    #[test]
    fn the_cut_is_the_decode_nodes_release_rule() {
        let l = gemma();
        let bs = 16;
        for tokens in [0, 1, 511, 512, 527, 528, 529, 4096, 4097] {
            let thin = l.thin_blocks(tokens);
            // Every thin block ends before the window of the token at `tokens`; the first whole
            // one does not.
            for i in 0..thin {
                assert!((i + 1) * bs <= tokens + 1 - 512, "{tokens}: block {i}");
            }
            assert!((thin + 1) * bs > (tokens + 1).saturating_sub(512), "{tokens}: {thin}");
        }
        assert_eq!((l.thin_blocks(511), l.thin_blocks(527), l.thin_blocks(528)), (0, 1, 1));
        assert_eq!(l.thin_blocks(4096), (4097 - 512) / 16);
        assert_eq!(KvLayout { window: None, ..l }.thin_blocks(4096), 0);
    }

    #[test]
    fn a_thin_block_is_its_global_layers_in_order() {
        let l = gemma();
        let bpl = l.geometry.bytes_per_layer();
        assert_eq!((l.global_layers(), l.wire_block_bytes(0, 1)), (3, 3 * bpl));
        assert_eq!(l.wire_block_bytes(1, 1), l.bytes_per_block());
        assert_eq!(l.wire_layer_offset(5, 0, 1), Some(0));
        assert_eq!(l.wire_layer_offset(11, 0, 1), Some(bpl));
        assert_eq!(l.wire_layer_offset(17, 0, 1), Some(2 * bpl));
        assert_eq!(l.wire_layer_offset(4, 0, 1), None);
        assert_eq!(l.wire_layer_offset(4, 1, 1), Some(4 * bpl));
        assert_eq!(l.wire_bytes(0, 4, 2), 2 * 3 * bpl + 2 * 18 * bpl);
        assert_eq!(l.wire_bytes(3, 4, 2), 18 * bpl);
        assert_eq!(l.wire_bytes(4, 3, 2), 0);
        let data = vec![0u8; l.wire_bytes(1, 4, 2)];
        let blocks = l.split_wire(1, 2, &data).expect("whole blocks");
        assert_eq!(blocks.iter().map(|b| b.len() / bpl).collect::<Vec<_>>(), [3, 18, 18]);
        assert!(l.split_wire(1, 2, &data[1..]).is_none(), "a torn block is not whole");
    }

    #[test]
    fn a_mask_holds_what_it_was_given() {
        let m = LayerMask::from_layers([0, 63, 64, 255]).unwrap();
        assert_eq!(m.layers().collect::<Vec<_>>(), [0, 63, 64, 255]);
        assert_eq!(m.count(), 4);
        assert!(!m.contains(1) && !m.contains(1000));
        assert!(LayerMask::from_layers([256]).is_none());
    }
}
