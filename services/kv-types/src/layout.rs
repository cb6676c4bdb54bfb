//! What a block of KV is: its element type, its geometry (where every element of every layer
//! sits in a block) and the layout two nodes compare before any block moves between them.
//!
//! One block is `[layer][K|V][kv_head][slot][head_dim]` elements: a block is one contiguous
//! region, a layer's part of a block is contiguous (so a layer can be shipped as soon as it is
//! computed), and one head's keys for consecutive tokens are contiguous (so attention streams).

use crate::KvWindow;

/// Element type of the KV cache.
///
/// `Q8_0` is llama.cpp's q8_0 block format for `type_k`/`type_v` (32 values as an f16 scale and
/// 32 `i8`, 34 bytes), with llama.cpp's default Hadamard rotation of Q, K, V and the attention
/// output when the head dimension is a multiple of 64; `Q8_0NoRot` is the same format without
/// the rotation (llama.cpp with `LLAMA_ATTN_ROT_DISABLE=1`). A rotated block means something
/// else than an unrotated one, so they are two dtypes and never mix in a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
    Q8_0,
    Q8_0NoRot,
}

/// Values per q8_0 block and its bytes (f16 scale + 32 `i8`).
pub const Q8_0_BLOCK: usize = 32;
pub const Q8_0_BLOCK_BYTES: usize = 34;

impl KvDtype {
    /// Every dtype, in the order `--help` lists them.
    pub const ALL: [KvDtype; 4] = [KvDtype::F16, KvDtype::F32, KvDtype::Q8_0, KvDtype::Q8_0NoRot];

    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
            KvDtype::Q8_0 => "q8_0",
            KvDtype::Q8_0NoRot => "q8_0-norot",
        }
    }

    /// Whether this is a q8_0 block format (either rotation).
    pub const fn is_q8_0(self) -> bool {
        matches!(self, KvDtype::Q8_0 | KvDtype::Q8_0NoRot)
    }

    /// Bytes of one head's row of `head_dim` values, or None when `head_dim` does not split
    /// into whole q8_0 blocks or the size overflows.
    pub const fn row_bytes(self, head_dim: usize) -> Option<usize> {
        match self {
            KvDtype::F16 => head_dim.checked_mul(2),
            KvDtype::F32 => head_dim.checked_mul(4),
            KvDtype::Q8_0 | KvDtype::Q8_0NoRot => {
                if head_dim.is_multiple_of(Q8_0_BLOCK) {
                    (head_dim / Q8_0_BLOCK).checked_mul(Q8_0_BLOCK_BYTES)
                } else {
                    None
                }
            }
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        KvDtype::ALL.into_iter().find(|d| d.name() == lower).ok_or_else(|| {
            let names: Vec<_> = KvDtype::ALL.iter().map(|d| d.name()).collect();
            format!("unknown KV dtype {s:?} (expected one of {})", names.join(", "))
        })
    }
}

/// The model's side of a KV block: how many layers and heads of which width it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The shape of a KV cache: everything needed to locate an element in a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl KvGeometry {
    /// A model's shape cut into blocks of `block_size` tokens of `dtype`.
    pub const fn new(shape: KvShape, block_size: usize, dtype: KvDtype) -> Self {
        Self {
            layers: shape.layers,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            block_size,
            dtype,
        }
    }

    /// Elements of K (or of V) for one token in one layer.
    pub const fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements in one layer's part of a block (K and V).
    pub const fn layer_elems(&self) -> usize {
        2 * self.kv_heads * self.block_size * self.head_dim
    }

    pub const fn block_elems(&self) -> usize {
        self.layers * self.layer_elems()
    }

    /// Bytes of one head's K (or V) row for one token. A geometry whose head_dim does not
    /// fit its dtype never passes `KvLayout::validate` or a model's configuration check.
    pub const fn row_bytes(&self) -> usize {
        match self.dtype.row_bytes(self.head_dim) {
            Some(n) => n,
            None => panic!("head_dim does not fit the KV dtype"),
        }
    }

    /// The memory ledger: bytes of KV one token costs (2 × layers × kv_heads × row bytes).
    pub const fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.row_bytes()
    }

    pub const fn bytes_per_block(&self) -> usize {
        self.layers * self.bytes_per_layer()
    }

    /// Bytes in one layer's part of a block.
    pub const fn bytes_per_layer(&self) -> usize {
        2 * self.kv_heads * self.block_size * self.row_bytes()
    }

    /// The Hadamard rotation sizes `(n_k, n_v)` llama.cpp applies with this dtype and head
    /// dimension: Q and K in runs of `n_k` (the largest power of two dividing head_dim), V and
    /// the attention output in runs of 64; None for float KV, `q8_0-norot`, or a head_dim
    /// that is not a multiple of 64.
    pub const fn rotation(&self) -> Option<(usize, usize)> {
        let hd = self.head_dim;
        if !matches!(self.dtype, KvDtype::Q8_0) || hd == 0 || !hd.is_multiple_of(64) {
            return None;
        }
        let mut n_k = 64;
        while hd.is_multiple_of(n_k * 2) {
            n_k *= 2;
        }
        Some((n_k, 64))
    }

    /// Blocks that hold `tokens` tokens.
    pub const fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Index of the row (one head's `head_dim` values) of `(block, layer, kv, head, slot)`;
    /// `kv` is 0 for K, 1 for V. Its bytes start at `row * row_bytes()`.
    #[inline(always)]
    pub const fn row(
        &self,
        block: usize,
        layer: usize,
        kv: usize,
        head: usize,
        slot: usize,
    ) -> usize {
        let rows_per_layer = 2 * self.kv_heads * self.block_size;
        (block * self.layers + layer) * rows_per_layer
            + (kv * self.kv_heads + head) * self.block_size
            + slot
    }

    /// Element offset of `(block, layer, kv, head, slot)`'s first dim, for the float dtypes
    /// (whose elements have a size); `kv` is 0 for K, 1 for V.
    #[inline(always)]
    pub const fn offset(
        &self,
        block: usize,
        layer: usize,
        kv: usize,
        head: usize,
        slot: usize,
    ) -> usize {
        self.row(block, layer, kv, head, slot) * self.head_dim
    }
}

/// The KV layout handshake: which model computed a block and what shape it has. Two nodes
/// exchange KV only when their layouts are equal; a block from another model or geometry is
/// never mixed in. The window (a model whose local layers attend through one) is also implied
/// by the fingerprint, but stated, since it decides which blocks travel thin (`window`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub model_fingerprint: u64,
    pub geometry: KvGeometry,
    pub window: Option<KvWindow>,
}

impl KvLayout {
    /// Checks a layout that came from elsewhere: every dimension non-zero and a block's size
    /// representable.
    pub fn validate(&self) -> Result<(), String> {
        let g = &self.geometry;
        for (name, v) in [
            ("block_size", g.block_size),
            ("layers", g.layers),
            ("kv_heads", g.kv_heads),
            ("head_dim", g.head_dim),
        ] {
            if v == 0 {
                return Err(format!("KV layout: {name} is 0"));
            }
        }
        if g.dtype.is_q8_0() && !g.head_dim.is_multiple_of(Q8_0_BLOCK) {
            return Err(format!(
                "KV layout: head_dim {} is not a multiple of {Q8_0_BLOCK}, which {} needs",
                g.head_dim, g.dtype
            ));
        }
        g.dtype
            .row_bytes(g.head_dim)
            .and_then(|row| {
                [g.block_size, g.layers, g.kv_heads, 2]
                    .iter()
                    .try_fold(row, |a, &x| a.checked_mul(x))
            })
            .ok_or_else(|| "KV layout: a block's size overflows".to_string())?;
        if let Some(w) = &self.window {
            if w.tokens == 0 {
                return Err("KV layout: the sliding window is 0 tokens".into());
            }
            if let Some(l) = w.local.layers().find(|&l| l >= g.layers) {
                return Err(format!("KV layout: window layer {l} is past the {} layers", g.layers));
            }
            // A thin block would be empty: the wire has no way to say so, and no model we load
            // windows every layer.
            if w.local.count() == g.layers {
                return Err("KV layout: every layer attends through the window".into());
            }
        }
        Ok(())
    }

    pub const fn bytes_per_block(&self) -> usize {
        self.geometry.bytes_per_block()
    }

    pub const fn block_size(&self) -> usize {
        self.geometry.block_size
    }

    /// Names every field on which `theirs` differs from `self`, or None when they agree.
    pub fn mismatch(&self, theirs: &KvLayout) -> Option<String> {
        let (a, b) = (&self.geometry, &theirs.geometry);
        let mut diffs = Vec::new();
        if self.model_fingerprint != theirs.model_fingerprint {
            diffs.push(format!(
                "model fingerprint {:016x} vs {:016x}",
                self.model_fingerprint, theirs.model_fingerprint
            ));
        }
        if a.dtype != b.dtype {
            diffs.push(format!("dtype {} vs {}", a.dtype, b.dtype));
        }
        for (name, x, y) in [
            ("block_size", a.block_size, b.block_size),
            ("layers", a.layers, b.layers),
            ("kv_heads", a.kv_heads, b.kv_heads),
            ("head_dim", a.head_dim, b.head_dim),
        ] {
            if x != y {
                diffs.push(format!("{name} {x} vs {y}"));
            }
        }
        if self.window != theirs.window {
            let say = |w: &Option<KvWindow>| match w {
                Some(w) => format!("{} tokens on {} layers", w.tokens, w.local.count()),
                None => "none".to_string(),
            };
            diffs.push(format!("window {} vs {}", say(&self.window), say(&theirs.window)));
        }
        (!diffs.is_empty()).then(|| diffs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom() -> KvGeometry {
        KvGeometry { layers: 30, kv_heads: 3, head_dim: 64, block_size: 16, dtype: KvDtype::F16 }
    }

    fn smollm() -> KvLayout {
        KvLayout { model_fingerprint: 0xabc, geometry: geom(), window: None }
    }

    #[test]
    fn ledger_matches_smollm2() {
        let g = geom();
        assert_eq!(g.bytes_per_token(), 2 * 30 * 3 * 64 * 2);
        assert_eq!(g.bytes_per_block(), 16 * g.bytes_per_token());
        // 16 tokens x 30 layers x (K+V) x 3 heads x 64 dims x 2 bytes = 360 KiB (368,640 B).
        assert_eq!(smollm().bytes_per_block(), 368_640);
        assert_eq!(g.bytes_per_layer() * 30, g.bytes_per_block());
        assert_eq!((g.blocks_for(16), g.blocks_for(17), g.blocks_for(0)), (1, 2, 0));
    }

    #[test]
    fn offsets_tile_a_block_without_overlap() {
        let g =
            KvGeometry { layers: 2, kv_heads: 2, head_dim: 4, block_size: 3, dtype: KvDtype::F32 };
        let mut seen = vec![false; 2 * g.block_elems()];
        for b in 0..2 {
            for l in 0..2 {
                for kv in 0..2 {
                    for h in 0..2 {
                        for s in 0..3 {
                            for d in 0..4 {
                                let o = g.offset(b, l, kv, h, s) + d;
                                assert!(!seen[o]);
                                seen[o] = true;
                            }
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn equal_layouts_pass_and_every_difference_is_named() {
        assert_eq!(smollm().mismatch(&smollm()), None);
        let other = KvLayout {
            geometry: KvGeometry { dtype: KvDtype::F32, block_size: 32, ..geom() },
            ..smollm()
        };
        let m = smollm().mismatch(&other).expect("differs");
        assert!(m.contains("dtype f16 vs f32") && m.contains("block_size 16 vs 32"), "{m}");
        let fp = KvLayout { model_fingerprint: 1, ..smollm() };
        assert!(smollm().mismatch(&fp).expect("differs").contains("fingerprint"));
    }

    #[test]
    fn validation_names_the_empty_dimension() {
        assert!(smollm().validate().is_ok());
        let e = KvLayout { geometry: KvGeometry { layers: 0, ..geom() }, ..smollm() };
        assert!(e.validate().expect_err("no layers").contains("layers"));
        let huge = KvLayout {
            geometry: KvGeometry { layers: usize::MAX / 2, head_dim: usize::MAX / 2, ..geom() },
            ..smollm()
        };
        assert!(huge.validate().expect_err("overflows").contains("overflows"));
    }

    #[test]
    fn dtype_parses_its_names() {
        assert_eq!("F16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert_eq!("f32".parse::<KvDtype>(), Ok(KvDtype::F32));
        assert_eq!("Q8_0".parse::<KvDtype>(), Ok(KvDtype::Q8_0));
        assert_eq!("q8_0-NoRot".parse::<KvDtype>(), Ok(KvDtype::Q8_0NoRot));
        let e = "q4".parse::<KvDtype>().expect_err("unknown");
        assert!(e.contains("\"q4\"") && e.contains("q8_0-norot"), "{e}");
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>(), Ok(d));
        }
    }

    #[test]
    fn q8_0_blocks_cost_34_bytes_per_32_values() {
        let g = KvGeometry { dtype: KvDtype::Q8_0, ..geom() };
        // 16 tokens x 30 layers x (K+V) x 3 heads x 2 q8_0 blocks of 34 bytes: 53.1% of f16.
        assert_eq!(g.row_bytes(), 68);
        assert_eq!(g.bytes_per_block(), 195_840);
        assert_eq!(g.bytes_per_token() * 16, g.bytes_per_block());
        assert_eq!(g.bytes_per_layer() * 30, g.bytes_per_block());
        // Rows tile a block in bytes, without overlap or gaps.
        let g = KvGeometry {
            layers: 2,
            kv_heads: 2,
            head_dim: 64,
            block_size: 3,
            dtype: KvDtype::Q8_0,
        };
        let mut seen = vec![false; 2 * g.bytes_per_block()];
        for b in 0..2 {
            for l in 0..2 {
                for kv in 0..2 {
                    for h in 0..2 {
                        for s in 0..3 {
                            let start = g.row(b, l, kv, h, s) * g.row_bytes();
                            for x in &mut seen[start..start + g.row_bytes()] {
                                assert!(!*x);
                                *x = true;
                            }
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn q8_0_needs_whole_blocks_per_head() {
        let l = |head_dim, dtype| KvLayout {
            geometry: KvGeometry { head_dim, dtype, ..geom() },
            ..smollm()
        };
        let e = l(80, KvDtype::Q8_0).validate().expect_err("80 is not a multiple of 32");
        assert!(e.contains("head_dim 80") && e.contains("q8_0"), "{e}");
        assert!(l(80, KvDtype::F16).validate().is_ok());
        assert!(l(96, KvDtype::Q8_0NoRot).validate().is_ok());
    }

    #[test]
    fn rotation_follows_llama_cpp() {
        let rot = |head_dim, dtype| KvGeometry { head_dim, dtype, ..geom() }.rotation();
        assert_eq!(rot(64, KvDtype::Q8_0), Some((64, 64)));
        assert_eq!(rot(128, KvDtype::Q8_0), Some((128, 64)));
        assert_eq!(rot(192, KvDtype::Q8_0), Some((64, 64)));
        assert_eq!(rot(256, KvDtype::Q8_0), Some((256, 64)));
        assert_eq!(rot(96, KvDtype::Q8_0), None);
        assert_eq!(rot(64, KvDtype::Q8_0NoRot), None);
        assert_eq!(rot(64, KvDtype::F16), None);
    }

    #[test]
    fn rotated_and_unrotated_q8_0_never_match() {
        let a = KvLayout { geometry: KvGeometry { dtype: KvDtype::Q8_0, ..geom() }, ..smollm() };
        let b =
            KvLayout { geometry: KvGeometry { dtype: KvDtype::Q8_0NoRot, ..geom() }, ..smollm() };
        assert!(a.mismatch(&b).expect("differs").contains("dtype q8_0 vs q8_0-norot"));
        assert!(smollm().mismatch(&a).expect("differs").contains("dtype f16 vs q8_0"));
    }
}
