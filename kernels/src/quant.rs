//! Weight storage formats (the GGML block layouts the engine reads straight out of a GGUF mmap)
//! and the quantized form of activations that the integer dot products consume.
//!
//! Activations are quantized the way llama.cpp does it for these weight types (32-element blocks,
//! scale `amax / 127` rounded to f16, round-half-even), so that pdmesh and llama.cpp see the same
//! numbers and greedy outputs agree.

use half::f16;

use crate::formats::{self, ActForm, FloatFormat, FloatKind, Format, QuantFormat};
use crate::kv::Phase;

/// Elements in one block of the 32-element formats (and of Q8 activations).
pub const QK: usize = 32;
/// Elements in one K-quant super-block (and of Q8K activations).
pub const QK_K: usize = 256;

/// The registry: every storage format pdmesh computes with, each implemented once in
/// `formats`. `WeightType` and every dispatch over it are generated from this list.
macro_rules! registry {
    (float: $($fv:ident),* ; quant: $($qv:ident),* $(;)?) => {
        /// How the elements of a weight matrix are stored.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum WeightType { $($fv,)* $($qv,)* }

        impl WeightType {
            /// Every format, floats first.
            pub const ALL: &'static [WeightType] = &[$(WeightType::$fv,)* $(WeightType::$qv,)*];

            /// Elements per storage block (1 for the float types).
            pub const fn block_elems(self) -> usize {
                match self {
                    $(WeightType::$fv => <formats::$fv as Format>::BLOCK_ELEMS,)*
                    $(WeightType::$qv => <formats::$qv as Format>::BLOCK_ELEMS,)*
                }
            }

            /// Bytes per storage block.
            pub const fn block_bytes(self) -> usize {
                match self {
                    $(WeightType::$fv => <formats::$fv as Format>::BLOCK_BYTES,)*
                    $(WeightType::$qv => <formats::$qv as Format>::BLOCK_BYTES,)*
                }
            }

            pub const fn name(self) -> &'static str {
                match self {
                    $(WeightType::$fv => <formats::$fv as Format>::NAME,)*
                    $(WeightType::$qv => <formats::$qv as Format>::NAME,)*
                }
            }

            /// The `ggml_type` id GGUF stores for this format.
            pub const fn gguf_id(self) -> u32 {
                match self {
                    $(WeightType::$fv => <formats::$fv as Format>::GGUF_ID,)*
                    $(WeightType::$qv => <formats::$qv as Format>::GGUF_ID,)*
                }
            }

            /// The format GGUF type `id` names, if pdmesh computes with it.
            pub fn from_gguf_id(id: u32) -> Option<Self> {
                $(if id == <formats::$fv as Format>::GGUF_ID { return Some(WeightType::$fv); })*
                $(if id == <formats::$qv as Format>::GGUF_ID { return Some(WeightType::$qv); })*
                None
            }

            /// The activation form matmuls against this format consume (`None`: a float one).
            pub const fn act_form(self) -> Option<ActForm> {
                match self {
                    $(WeightType::$fv => None,)*
                    $(WeightType::$qv => Some(<formats::$qv as QuantFormat>::ACT),)*
                }
            }

            /// For the float formats, which float path they take.
            pub const fn float_kind(self) -> Option<FloatKind> {
                match self {
                    $(WeightType::$fv => Some(<formats::$fv as FloatFormat>::KIND),)*
                    $(WeightType::$qv => None,)*
                }
            }
        }

        /// Dequantizes one row of `ty` blocks into f32.
        pub fn dequantize_row(ty: WeightType, row: &[u8], out: &mut [f32]) {
            match ty {
                $(WeightType::$fv => dequantize_with::<formats::$fv>(row, out),)*
                $(WeightType::$qv => dequantize_with::<formats::$qv>(row, out),)*
            }
        }

        impl WeightType {
            /// Calls the visitor's method for this format's type.
            #[inline(always)]
            pub fn visit<V: FormatVisitor>(self, v: V) -> V::Out {
                match self {
                    $(WeightType::$fv => v.float::<formats::$fv>(),)*
                    $(WeightType::$qv => v.quant::<formats::$qv>(),)*
                }
            }
        }
    };
}

registry! {
    float: F32, F16, BF16;
    quant: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K;
}

/// Code generic over the format, run for a `WeightType` known only at run time.
pub trait FormatVisitor {
    type Out;
    fn float<F: FloatFormat>(self) -> Self::Out;
    fn quant<F: QuantFormat>(self) -> Self::Out;
}

fn dequantize_with<F: Format>(row: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(F::BLOCK_ELEMS).zip(row.chunks_exact(F::BLOCK_BYTES)) {
        F::dequantize(b, o);
    }
}

impl WeightType {
    /// Bytes taken by a row of `cols` elements, or `None` when `cols` is not a whole number of
    /// blocks (or overflows).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_elems()) {
            return None;
        }
        (cols / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Whether matmuls against this type run on quantized (int8) activations.
    pub const fn is_quantized(self) -> bool {
        self.act_form().is_some()
    }
}

impl std::fmt::Display for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        WeightType::ALL.iter().copied().find(|t| t.name().eq_ignore_ascii_case(s)).ok_or_else(
            || {
                let known: Vec<&str> = WeightType::ALL.iter().map(|t| t.name()).collect();
                format!("unknown weight format {s:?} (known: {})", known.join(", "))
            },
        )
    }
}

/// Which forms of an activation batch the matmuls that read it need (f32 is always kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActNeeds {
    pub q8: bool,
    pub q8k: bool,
    /// Rounded to f16 (F16 weights).
    pub f16: bool,
    /// Rounded to bf16 (BF16 weights).
    pub bf16: bool,
}

impl ActNeeds {
    /// What matmuls against weights of these types consume.
    pub fn of(types: impl IntoIterator<Item = WeightType>) -> Self {
        let mut n = ActNeeds::default();
        for t in types {
            match t.act_form() {
                Some(ActForm::Q8) => n.q8 = true,
                Some(ActForm::Q8K) => n.q8k = true,
                None => {}
            }
            match t.float_kind() {
                Some(FloatKind::F16) => n.f16 = true,
                Some(FloatKind::BF16) => n.bf16 = true,
                Some(FloatKind::F32) | None => {}
            }
        }
        n
    }

    pub fn has(self, form: ActForm) -> bool {
        match form {
            ActForm::Q8 => self.q8,
            ActForm::Q8K => self.q8k,
        }
    }

    /// Whether the rounded form float weights of `kind` read is present (f32 always is).
    pub fn has_float(self, kind: FloatKind) -> bool {
        match kind {
            FloatKind::F32 => true,
            FloatKind::F16 => self.f16,
            FloatKind::BF16 => self.bf16,
        }
    }
}

/// A borrowed row-major weight matrix: `rows` rows of `cols` elements in `ty` blocks.
#[derive(Debug, Clone, Copy)]
pub struct WeightMatrix<'a> {
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

/// Why a byte slice cannot be viewed as a weight matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("{cols} columns is not a whole number of {ty} blocks of {block} elements")]
    PartialBlock { ty: WeightType, cols: usize, block: usize },
    #[error("{ty} matrix of {rows}x{cols} needs {need} bytes, got {got}")]
    WrongSize { ty: WeightType, rows: usize, cols: usize, need: usize, got: usize },
}

impl<'a> WeightMatrix<'a> {
    pub fn new(
        ty: WeightType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, LayoutError> {
        let row = ty.row_bytes(cols).ok_or(LayoutError::PartialBlock {
            ty,
            cols,
            block: ty.block_elems(),
        })?;
        let need = row.saturating_mul(rows);
        if need != data.len() {
            return Err(LayoutError::WrongSize { ty, rows, cols, need, got: data.len() });
        }
        Ok(Self { ty, rows, cols, data })
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Dequantizes row `r` into `out` (length `cols`), exactly as the matmul kernels see it.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.row(r), out);
    }
}

/// Bytes that share their owner (a model file's map) with whoever else reads it: a weight keeps
/// the file it views alive, wherever it is moved.
#[derive(Clone)]
pub struct SharedBytes {
    owner: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: std::ops::Range<usize>,
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBytes").field("range", &self.range).finish()
    }
}

impl SharedBytes {
    /// `range` of `owner`'s bytes; None when it is out of bounds.
    pub fn new(
        owner: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>,
        range: std::ops::Range<usize>,
    ) -> Option<Self> {
        let len = (*owner).as_ref().len();
        (range.start <= range.end && range.end <= len).then_some(Self { owner, range })
    }

    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }
}

/// A weight matrix in host memory, sharing the bytes of its source: what a host backend
/// computes with directly and a device backend uploads.
#[derive(Debug, Clone)]
pub struct HostWeight {
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    bytes: SharedBytes,
}

impl HostWeight {
    /// Checks that `bytes` hold exactly a `rows × cols` matrix of `ty`.
    pub fn new(
        ty: WeightType,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
    ) -> Result<Self, LayoutError> {
        WeightMatrix::new(ty, rows, cols, bytes.bytes())?;
        Ok(Self { ty, rows, cols, bytes })
    }

    /// The matrix as the kernels read it.
    pub fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix { ty: self.ty, rows: self.rows, cols: self.cols, data: self.bytes.bytes() }
    }
}

/// Reads a little-endian f16 at `b[0..2]` as f32.
#[inline(always)]
pub fn f16_at(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Rounds through f16, as llama.cpp does when it stores block scales.
#[inline(always)]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// A batch of activation rows (one per token), kept as f32 and quantized into the forms the
/// matmuls reading it need: 32-element Q8 blocks and/or 256-element Q8K super-blocks.
#[derive(Debug, Default, Clone)]
pub struct Activations {
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols` original values (used by float weights).
    pub f32: Vec<f32>,
    /// Q8: `rows × cols` int8 quants.
    pub qs: Vec<i8>,
    /// Q8: `rows × cols/32` block scales (already rounded through f16), block-major
    /// (`[block][row]`) so a tile scales consecutive tokens at once.
    pub d: Vec<f32>,
    /// Q8: scale × sum of quants per block (rounded through f16), for the Q4_1/Q5_1 min term;
    /// stored block-major (`[block][row]`) so a tile loads consecutive tokens' terms at once.
    pub s: Vec<f32>,
    /// Q8K: `rows × cols` int8 quants.
    pub kqs: Vec<i8>,
    /// Q8K: `rows × cols/256` super-block scales (f32, `1 / iscale` as llama.cpp stores it).
    pub kd: Vec<f32>,
    /// Q8K: `rows × cols/16` sums of each 16 quants (the K-quants' mins and Q6_K's offset).
    pub ksums: Vec<i16>,
    /// Q8K: `rows × cols/32` sums of each 32 quants (pairs of `ksums`), which the Q4_K/Q5_K
    /// min term multiplies by the eight sub-block mins.
    pub kpairs: Vec<i16>,
    /// F16 weights: `rows × cols` values rounded to f16 (ties to even), held as f32.
    pub h: Vec<f32>,
    /// BF16 weights: `rows × cols` values rounded to bf16 (ties to even), as bf16 bits.
    pub bh: Vec<u16>,
    /// Each row's phase: float weights sum prompt and decode tokens in different orders, as
    /// llama.cpp's batched and single-token kernels do.
    pub phases: Vec<Phase>,
    /// Which forms the buffers currently hold.
    pub forms: ActNeeds,
}

impl Activations {
    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }

    /// Whether the batch holds the quantized form `form`.
    pub fn has(&self, form: ActForm) -> bool {
        self.forms.has(form)
    }

    /// Sizes the buffers for `rows × cols` and the forms in `needs` (those whose block does not
    /// divide `cols` are left out), without shrinking capacity.
    pub fn resize(&mut self, rows: usize, cols: usize, needs: ActNeeds) {
        self.rows = rows;
        self.cols = cols;
        self.f32.resize(rows * cols, 0.0);
        self.phases.resize(rows, Phase::Prefill);
        self.forms = ActNeeds {
            q8: needs.q8 && cols.is_multiple_of(QK),
            q8k: needs.q8k && cols.is_multiple_of(QK_K),
            f16: needs.f16,
            bf16: needs.bf16,
        };
        let sized = |on: bool| if on { rows * cols } else { 0 };
        self.h.resize(sized(self.forms.f16), 0.0);
        self.bh.resize(sized(self.forms.bf16), 0);
        if self.forms.q8 {
            self.qs.resize(rows * cols, 0);
            self.d.resize(rows * cols / QK, 0.0);
            self.s.resize(rows * cols / QK, 0.0);
        } else {
            self.qs.clear();
            self.d.clear();
            self.s.clear();
        }
        if self.forms.q8k {
            self.kqs.resize(rows * cols, 0);
            self.kd.resize(rows * cols / QK_K, 0.0);
            self.ksums.resize(rows * cols / 16, 0);
            self.kpairs.resize(rows * cols / 32, 0);
        } else {
            self.kqs.clear();
            self.kd.clear();
            self.ksums.clear();
            self.kpairs.clear();
        }
    }
}

/// Quantizes one super-block of 256 values: llama.cpp's `quantize_row_q8_K_ref`, which every
/// CPU build of it uses (scale from the signed value of largest magnitude, first one wins).
/// Writes the quants and the sixteen 16-element sums; returns the scale.
#[inline(always)]
pub fn quantize_block_k(x: &[f32], qs: &mut [i8], sums: &mut [i16]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        qs.fill(0);
        sums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in qs.iter_mut().zip(x) {
        // The product is rounded to f32 before it is rounded to an integer: llama.cpp's
        // `nearest_int(iscale * x)` is not contracted into one FMA (checked against its build).
        *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
    }
    for (s, run) in sums.iter_mut().zip(qs.chunks_exact(16)) {
        *s = run.iter().map(|&q| i16::from(q)).sum();
    }
    1.0 / iscale
}

/// Quantizes one block of 32 values: llama.cpp's `quantize_row_q8_1` semantics.
/// Returns `(d, s)` with both rounded through f16.
#[inline(always)]
pub fn quantize_block(x: &[f32], qs: &mut [i8]) -> (f32, f32) {
    let mut amax = 0.0f32;
    for &v in x {
        amax = amax.max(v.abs());
    }
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    (round_f16(d), round_f16(d * sum as f32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_rejects_partial_blocks() {
        assert_eq!(WeightType::Q4_1.row_bytes(64), Some(40));
        assert_eq!(WeightType::Q4_1.row_bytes(48), None);
        assert_eq!(WeightType::F16.row_bytes(7), Some(14));
    }

    #[test]
    fn weight_matrix_checks_size() {
        let data = vec![0u8; 34 * 2];
        assert!(WeightMatrix::new(WeightType::Q8_0, 2, 32, &data).is_ok());
        assert!(matches!(
            WeightMatrix::new(WeightType::Q8_0, 3, 32, &data),
            Err(LayoutError::WrongSize { .. })
        ));
    }

    #[test]
    fn quantize_block_round_trips_within_half_step() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) * 0.37).collect();
        let mut q = [0i8; 32];
        let (d, s) = quantize_block(&x, &mut q);
        for (&v, &q) in x.iter().zip(&q) {
            assert!((v - f32::from(q) * d).abs() <= d * 0.5 + 1e-3, "{v} vs {}", f32::from(q) * d);
        }
        let sum: i32 = q.iter().map(|&q| i32::from(q)).sum();
        assert!((s - d * sum as f32).abs() <= s.abs() * 1e-3 + 1e-3);
        assert_eq!(q.iter().map(|q| q.unsigned_abs()).max(), Some(127));
    }

    #[test]
    fn quantize_block_k_takes_the_sign_of_the_first_largest() {
        let mut x = [0.5f32; 256];
        x[3] = -2.0;
        x[9] = 2.0;
        let (mut q, mut sums) = ([0i8; 256], [0i16; 16]);
        let d = quantize_block_k(&x, &mut q, &mut sums);
        // max = -2 → iscale = 63.5, so -2 ↦ -127 and d = 1/63.5.
        assert_eq!((q[3], q[9], q[0]), (-127, 127, 32));
        assert_eq!(d, 1.0 / 63.5);
        assert_eq!(sums[0], 14 * 32);
    }

    #[test]
    fn quantize_block_k_rounds_the_f32_product() {
        // iscale · v is exactly -43.5 in f32 (ties to even: -44) but -43.4999989 exactly, which
        // a fused multiply-round would give -43; llama.cpp's quantizer gives -44.
        let mut x = [0.0f32; 256];
        x[0] = f32::from_bits(1_077_642_548); // 2.930005, the largest magnitude
        x[1] = f32::from_bits(1_065_383_284); // 1.0035844
        let (mut q, mut sums) = ([0i8; 256], [0i16; 16]);
        quantize_block_k(&x, &mut q, &mut sums);
        assert_eq!((q[0], q[1]), (-127, -44));
    }

    #[test]
    fn quantize_block_k_rounds_the_product_before_the_integer() {
        // From a Qwen2 attention output: iscale · x is -50.50000026 exactly, -50.5 in f32,
        // and llama.cpp (no FMA there) rounds that tie to even: -50, where one FMA gives -51.
        let mut x = [0.0f32; 256];
        x[138] = f32::from_bits(0xbf7a_ec73);
        x[71] = f32::from_bits(0xbec7_8dae);
        let (mut q, mut sums) = ([0i8; 256], [0i16; 16]);
        quantize_block_k(&x, &mut q, &mut sums);
        assert_eq!((q[138], q[71]), (-127, -50));
    }

    #[test]
    fn quantize_zero_block() {
        let mut q = [1i8; 32];
        assert_eq!(quantize_block(&[0.0; 32], &mut q), (0.0, 0.0));
        assert!(q.iter().all(|&q| q == 0));
    }

    #[test]
    fn dequantize_q4_1_nibble_order() {
        // d = 1.0, m = -2.0; byte j holds element j (low nibble) and j+16 (high nibble).
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-2.0).to_bits().to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0.0; 32];
        dequantize_row(WeightType::Q4_1, &b, &mut out);
        assert_eq!(out[0], -2.0);
        assert_eq!(out[5], 3.0);
        assert_eq!(out[16], 13.0);
        assert_eq!(out[31], -2.0);
    }
}
