//! Weight storage formats (the GGML block layouts the engine reads straight out of a GGUF mmap)
//! and the quantized form of activations that the integer dot products consume.
//!
//! Activations are quantized the way llama.cpp does it for these weight types (32-element blocks,
//! scale `amax / 127` rounded to f16, round-half-even), so that pdmesh and llama.cpp see the same
//! numbers and greedy outputs agree.

use half::f16;

/// Elements in one quantization block for every block format here.
pub const QK: usize = 32;

/// How the elements of a weight matrix are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    BF16,
    /// 32 weights: f16 scale, 32 × i8.
    Q8_0,
    /// 32 weights: f16 scale, 32 × 4-bit (value − 8).
    Q4_0,
    /// 32 weights: f16 scale, f16 min, 32 × 4-bit.
    Q4_1,
}

impl WeightType {
    /// Elements per storage block (1 for the float types).
    pub const fn block_elems(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => 1,
            WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1 => QK,
        }
    }

    /// Bytes per storage block.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 | WeightType::BF16 => 2,
            WeightType::Q8_0 => 2 + QK,
            WeightType::Q4_0 => 2 + QK / 2,
            WeightType::Q4_1 => 4 + QK / 2,
        }
    }

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
        matches!(self, WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1)
    }

    pub const fn name(self) -> &'static str {
        match self {
            WeightType::F32 => "F32",
            WeightType::F16 => "F16",
            WeightType::BF16 => "BF16",
            WeightType::Q8_0 => "Q8_0",
            WeightType::Q4_0 => "Q4_0",
            WeightType::Q4_1 => "Q4_1",
        }
    }
}

impl std::fmt::Display for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
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

/// Dequantizes one row of `ty` blocks into f32.
pub fn dequantize_row(ty: WeightType, row: &[u8], out: &mut [f32]) {
    match ty {
        WeightType::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WeightType::F16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16_at(c);
            }
        }
        WeightType::BF16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        WeightType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(ty.block_bytes())) {
                let d = f16_at(b);
                for (o, &q) in o.iter_mut().zip(&b[2..]) {
                    *o = f32::from(q as i8) * d;
                }
            }
        }
        WeightType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(ty.block_bytes())) {
                let d = f16_at(b);
                for (j, &q) in b[2..].iter().enumerate() {
                    o[j] = f32::from((q & 0xF) as i8 - 8) * d;
                    o[j + QK / 2] = f32::from((q >> 4) as i8 - 8) * d;
                }
            }
        }
        WeightType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(ty.block_bytes())) {
                let d = f16_at(b);
                let m = f16_at(&b[2..]);
                for (j, &q) in b[4..].iter().enumerate() {
                    o[j] = f32::from(q & 0xF) * d + m;
                    o[j + QK / 2] = f32::from(q >> 4) * d + m;
                }
            }
        }
    }
}

/// A batch of activation rows (one per token), kept as f32 and, when the row length is a whole
/// number of blocks, also quantized to int8 blocks for the integer dot products.
#[derive(Debug, Default, Clone)]
pub struct Activations {
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols` original values (used by float weights).
    pub f32: Vec<f32>,
    /// `rows × cols` int8 quants.
    pub qs: Vec<i8>,
    /// `rows × cols/32` block scales (already rounded through f16).
    pub d: Vec<f32>,
    /// Scale × sum of quants per block (rounded through f16), for Q4_1's min term; stored
    /// block-major (`[block][row]`) so a tile loads consecutive tokens' terms at once.
    pub s: Vec<f32>,
}

impl Activations {
    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }

    pub fn is_quantized(&self) -> bool {
        self.cols.is_multiple_of(QK) && self.qs.len() == self.rows * self.cols
    }

    /// Sizes the buffers for `rows × cols` without shrinking capacity.
    pub fn resize(&mut self, rows: usize, cols: usize) {
        self.rows = rows;
        self.cols = cols;
        self.f32.resize(rows * cols, 0.0);
        if cols.is_multiple_of(QK) {
            self.qs.resize(rows * cols, 0);
            self.d.resize(rows * cols / QK, 0.0);
            self.s.resize(rows * cols / QK, 0.0);
        } else {
            self.qs.clear();
            self.d.clear();
            self.s.clear();
        }
    }
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
