//! What a block of KV is: its element type, its geometry (where every element of every layer
//! sits in a block) and the layout two nodes compare before any block moves between them.
//!
//! One block is `[layer][K|V][kv_head][slot][head_dim]` elements: a block is one contiguous
//! region, a layer's part of a block is contiguous (so a layer can be shipped as soon as it is
//! computed), and one head's keys for consecutive tokens are contiguous (so attention streams).

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub const fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
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
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            other => Err(format!("unknown KV dtype {other:?} (expected f16 or f32)")),
        }
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

    /// The memory ledger: bytes of KV one token costs (2 × layers × kv_heads × head_dim × bytes).
    pub const fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype.bytes()
    }

    pub const fn bytes_per_block(&self) -> usize {
        self.block_elems() * self.dtype.bytes()
    }

    /// Bytes in one layer's part of a block.
    pub const fn bytes_per_layer(&self) -> usize {
        self.layer_elems() * self.dtype.bytes()
    }

    /// Blocks that hold `tokens` tokens.
    pub const fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Element offset of `(block, layer, kv, head, slot)`'s first dim; `kv` is 0 for K, 1 for V.
    #[inline(always)]
    pub const fn offset(
        &self,
        block: usize,
        layer: usize,
        kv: usize,
        head: usize,
        slot: usize,
    ) -> usize {
        block * self.block_elems()
            + layer * self.layer_elems()
            + ((kv * self.kv_heads + head) * self.block_size + slot) * self.head_dim
    }
}

/// The KV layout handshake: which model computed a block and what shape it has. Two nodes
/// exchange KV only when their layouts are equal; a block from another model or geometry is
/// never mixed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub model_fingerprint: u64,
    pub geometry: KvGeometry,
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
        [g.block_size, g.layers, g.kv_heads, g.head_dim, 2]
            .iter()
            .try_fold(g.dtype.bytes(), |acc, &x| acc.checked_mul(x))
            .map(|_| ())
            .ok_or_else(|| "KV layout: a block's size overflows".to_string())
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
        KvLayout { model_fingerprint: 0xabc, geometry: geom() }
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
        assert!("q4".parse::<KvDtype>().expect_err("unknown").contains("q4"));
    }
}
