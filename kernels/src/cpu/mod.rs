//! The CPU backend: picks the best instruction set at run time (AVX2/FMA/F16C on x86-64, the
//! portable kernels elsewhere) and spreads each operation over a fixed thread pool.

#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub(crate) mod ops;
pub mod portable;
pub mod q8kv;

pub use ops::gelu_table;

use std::sync::atomic::{AtomicUsize, Ordering};

use half::slice::HalfFloatSliceExt;

use crate::backend::{Backend, KvError, MatmulJob, RopeMode};
use crate::kv::{AttnQuery, KvBuffer, KvData, KvDataMut, KvGeometry, KvSlot, Phase};
use crate::pool::{SharedMut, ThreadPool, split};
use crate::quant::{ActNeeds, Activations, HostWeight, WeightMatrix};
use ops::Isa;

/// Which kernels the CPU backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// Plain Rust; the reference every other kernel is tested against.
    Portable,
    /// AVX2 + FMA + F16C (x86-64).
    Avx2,
    /// The AVX2 kernels with AVX512-VNNI integer dot products (x86-64 with AVX-512).
    Avx512Vnni,
}

impl Simd {
    /// The best kernels this CPU supports.
    pub fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                if std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    return Simd::Avx512Vnni;
                }
                return Simd::Avx2;
            }
        }
        Simd::Portable
    }

    pub fn is_supported(self) -> bool {
        match (self, Simd::detect()) {
            (Simd::Portable, _) => true,
            (Simd::Avx2, best) => best != Simd::Portable,
            (Simd::Avx512Vnni, best) => best == Simd::Avx512Vnni,
        }
    }

    /// Every level this CPU supports, from the reference up.
    pub fn available() -> Vec<Simd> {
        [Simd::Portable, Simd::Avx2, Simd::Avx512Vnni]
            .into_iter()
            .filter(|s| s.is_supported())
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            Simd::Avx2 => "avx2",
            Simd::Avx512Vnni => "avx512vnni",
        }
    }
}

impl std::str::FromStr for Simd {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "portable" => Ok(Simd::Portable),
            "avx2" => Ok(Simd::Avx2),
            "avx512vnni" => Ok(Simd::Avx512Vnni),
            other => {
                Err(format!("unknown SIMD level {other:?} (expected portable, avx2 or avx512vnni)"))
            }
        }
    }
}

#[derive(Clone, Copy)]
struct PortableIsa;

impl Isa for PortableIsa {
    #[inline(always)]
    fn qk_dot(self, q: &[f32], kv: &KvData, off: usize, phase: Phase) -> f32 {
        portable::qk_dot(q, kv, off, phase)
    }
    #[inline(always)]
    fn kv_axpy(self, p: f32, kv: &KvData, off: usize, out: &mut [f32]) {
        portable::kv_axpy(p, kv, off, out)
    }
    #[inline(always)]
    fn round_f16(self, x: &mut [f32]) {
        for v in x {
            *v = half::f16::from_f32(*v).to_f32();
        }
    }
}

/// Proof that AVX2/FMA/F16C are present: only `CpuBackend::with_simd` makes one, after checking.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2Isa(());

#[cfg(target_arch = "x86_64")]
impl Isa for Avx2Isa {
    #[inline(always)]
    fn qk_dot(self, q: &[f32], kv: &KvData, off: usize, phase: Phase) -> f32 {
        // SAFETY: an `Avx2Isa` exists only when the CPU supports the features.
        unsafe { avx2::qk_dot(q, kv, off, phase) }
    }
    #[inline(always)]
    fn kv_axpy(self, p: f32, kv: &KvData, off: usize, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { avx2::kv_axpy(p, kv, off, out) }
    }
    #[inline(always)]
    fn round_f16(self, x: &mut [f32]) {
        // SAFETY: as above.
        unsafe { avx2::round_f16_slice(x) }
    }
    #[inline(always)]
    fn exp16(self, chunk: &mut [f32], max: f32, from: usize, valid: usize) -> f32 {
        // SAFETY: as above.
        unsafe { avx2::exp16(chunk, max, from, valid) }
    }
    #[inline(always)]
    fn dot_q8_0(self, k: &[u8], q: &[u8]) -> f32 {
        // SAFETY: as above.
        unsafe { avx2::dot_q8_0(k, q) }
    }
    #[inline(always)]
    fn dequantize_q8_0(self, row: &[u8], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { avx2::dequantize_row_q8_0(row, out) }
    }
}

/// The generic ops compiled with AVX2 enabled, so the compiler vectorises them for it.
#[cfg(target_arch = "x86_64")]
mod avx2_ops {
    use super::*;

    macro_rules! wrap {
        ($($name:ident ( $($a:ident : $t:ty),* );)*) => {$(
            /// # Safety
            /// The CPU must support AVX2, FMA and F16C.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name($($a: $t),*) { ops::$name($($a),*) }
        )*};
    }

    wrap! {
        rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]);
        swiglu(gate: &[f32], up: &[f32], out: &mut [f32]);
        geglu(table: &[f32], gate: &[f32], up: &[f32], out: &mut [f32]);
        scale(x: &mut [f32], s: f32);
        quantize_row_q8_0(x: &[f32], out: &mut [u8]);
        add_assign(x: &mut [f32], y: &[f32]);
        add_rows(x: &mut [f32], bias: &[f32]);
        rope_rows(
            x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32], mode: RopeMode
        );
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn attend(
        isa: Avx2Isa,
        geom: &KvGeometry,
        kv: &KvData,
        layer: usize,
        kv_head: usize,
        query: &AttnQuery<'_>,
        q: &[f32],
        scale: f32,
        out: &mut [f32],
        scratch: &mut ops::AttnScratch,
    ) {
        if !matches!(kv, KvData::Q8_0(_)) && avx2::attend_fits(geom.head_dim, query.phase) {
            // SAFETY: AVX2 enabled here; the caller checked the block table.
            unsafe { avx2::attend(geom, kv, layer, kv_head, query, q, scale, out, scratch) }
        } else {
            ops::attend(isa, geom, kv, layer, kv_head, query, q, scale, out, scratch)
        }
    }
}

/// Runs `$f(args)` with the backend's kernels: the shared body for portable, its AVX2
/// instantiation when the CPU has it.
macro_rules! dispatch {
    ($self:expr, $f:ident ( $($arg:expr),* )) => {
        match $self.simd {
            Simd::Portable => ops::$f($($arg),*),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `simd` is an x86 level only when the CPU supports it (checked in `with_simd`).
            Simd::Avx2 | Simd::Avx512Vnni => unsafe { avx2_ops::$f($($arg),*) },
            #[cfg(not(target_arch = "x86_64"))]
            Simd::Avx2 | Simd::Avx512Vnni => unreachable!("x86 kernels are never selected off x86-64"),
        }
    };
}

/// Element-wise work below this many elements runs on the calling thread: waking the pool
/// costs more than it saves.
const PARALLEL_MIN_ELEMS: usize = 1 << 15;

/// Rows of a matmul handed out together (matches the widest row tile).
const MATMUL_UNIT: usize = 4;
/// Units a thread claims at once from a matmul's shared row space (64 rows).
const MATMUL_GRAIN: usize = 16;

/// Why a CPU backend cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("this CPU does not support the {0} kernels")]
    Unsupported(&'static str),
}

/// Computes on the host CPU with `threads` threads.
#[derive(Debug)]
pub struct CpuBackend {
    pool: ThreadPool,
    simd: Simd,
}

impl CpuBackend {
    /// The fastest kernels this CPU supports, on `threads` threads (0 = all cores).
    pub fn new(threads: usize) -> Self {
        Self::with_simd(threads, Simd::detect()).expect("detected SIMD level is supported")
    }

    /// A backend with an explicit kernel choice (tests compare them).
    pub fn with_simd(threads: usize, simd: Simd) -> Result<Self, CpuError> {
        if !simd.is_supported() {
            return Err(CpuError::Unsupported(simd.name()));
        }
        let threads = if threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            threads
        };
        Ok(Self { pool: ThreadPool::new(threads), simd })
    }

    pub fn simd(&self) -> Simd {
        self.simd
    }

    /// Runs `f` over row ranges of `rows` rows of `row_elems` elements, in parallel when large.
    fn rows_par(&self, rows: usize, row_elems: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
        if rows * row_elems < PARALLEL_MIN_ELEMS || self.pool.threads() == 1 {
            f(0..rows);
        } else {
            self.pool.for_ranges(rows, f);
        }
    }

    fn matmul_rows(
        &self,
        w: &WeightMatrix<'_>,
        x: &Activations,
        rows: std::ops::Range<usize>,
        out: &SharedMut<f32>,
    ) {
        match self.simd {
            Simd::Portable => portable::matmul_rows(w, x, rows, out, w.rows, 0),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 was verified at construction; `out` holds `x.rows × w.rows`.
            Simd::Avx2 => unsafe { avx2::matmul_rows(w, x, rows, out, w.rows, 0) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX512-VNNI was verified at construction; as above.
            Simd::Avx512Vnni => unsafe { avx2::matmul_rows_vnni(w, x, rows, out, w.rows, 0) },
            #[cfg(not(target_arch = "x86_64"))]
            Simd::Avx2 | Simd::Avx512Vnni => {
                unreachable!("x86 kernels are never selected off x86-64")
            }
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Activations = Activations;
    type Kv = KvBuffer;
    type Weight = HostWeight;

    fn describe(&self) -> String {
        format!("cpu/{} x{}", self.simd.name(), self.pool.threads())
    }

    fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn buffer(&self) -> Vec<f32> {
        Vec::new()
    }

    fn activations(&self) -> Activations {
        Activations::default()
    }

    fn resize(&self, buf: &mut Vec<f32>, len: usize) {
        buf.resize(len, 0.0);
    }

    fn upload(&self, host: &[f32], buf: &mut Vec<f32>) {
        buf.clear();
        buf.extend_from_slice(host);
    }

    fn read<'a>(&self, buf: &'a Vec<f32>, _host: &'a mut Vec<f32>) -> &'a [f32] {
        buf
    }

    fn kv(&self, geometry: KvGeometry, blocks: usize) -> Result<KvBuffer, KvError> {
        KvBuffer::new(geometry, blocks)
    }

    fn weight(&self, w: &HostWeight) -> HostWeight {
        w.clone()
    }

    fn gather_rows(&self, x: &Vec<f32>, rows: &[usize], width: usize, out: &mut Vec<f32>) {
        out.resize(rows.len() * width, 0.0);
        for (o, &r) in out.chunks_exact_mut(width.max(1)).zip(rows) {
            o.copy_from_slice(&x[r * width..(r + 1) * width]);
        }
    }

    fn quantize(
        &self,
        x: &Vec<f32>,
        rows: usize,
        cols: usize,
        needs: ActNeeds,
        phases: &[Phase],
        out: &mut Activations,
    ) {
        assert_eq!(x.len(), rows * cols, "quantize: input is not rows × cols");
        assert_eq!(phases.len(), rows, "quantize: one phase per row");
        out.resize(rows, cols, needs);
        out.f32.copy_from_slice(x);
        out.phases.copy_from_slice(phases);
        // Rounded as llama.cpp's `ggml_cpu_fp32_to_fp16`/`_bf16` do: to nearest, ties to even.
        if out.forms.f16 {
            for (h, &v) in out.h.iter_mut().zip(x) {
                *h = half::f16::from_f32(v).to_f32();
            }
        }
        if out.forms.bf16 {
            for (h, &v) in out.bh.iter_mut().zip(x) {
                *h = half::bf16::from_f32(v).to_bits();
            }
        }
        if out.forms.q8 {
            let qs = SharedMut::new(&mut out.qs);
            let d = SharedMut::new(&mut out.d);
            let s = SharedMut::new(&mut out.s);
            self.rows_par(rows, cols, |r| match self.simd {
                Simd::Portable => portable::quantize_rows(x, cols, &qs, &d, &s, rows, r),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 verified at construction; buffers sized by `resize` above.
                Simd::Avx2 | Simd::Avx512Vnni => unsafe {
                    avx2::quantize_rows(x, cols, &qs, &d, &s, rows, r)
                },
                #[cfg(not(target_arch = "x86_64"))]
                Simd::Avx2 | Simd::Avx512Vnni => {
                    unreachable!("x86 kernels are never selected off x86-64")
                }
            });
        }
        if out.forms.q8k {
            let qs = SharedMut::new(&mut out.kqs);
            let d = SharedMut::new(&mut out.kd);
            let sums = SharedMut::new(&mut out.ksums);
            let pairs = SharedMut::new(&mut out.kpairs);
            self.rows_par(rows, cols, |r| match self.simd {
                Simd::Portable => portable::quantize_rows_k(x, cols, &qs, &d, &sums, &pairs, r),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 verified at construction; buffers sized by `resize` above.
                Simd::Avx2 | Simd::Avx512Vnni => unsafe {
                    avx2::quantize_rows_k(x, cols, &qs, &d, &sums, &pairs, r)
                },
                #[cfg(not(target_arch = "x86_64"))]
                Simd::Avx2 | Simd::Avx512Vnni => {
                    unreachable!("x86 kernels are never selected off x86-64")
                }
            });
        }
    }

    fn matmul(&self, x: &Activations, jobs: &mut [MatmulJob<'_, HostWeight, Vec<f32>>]) {
        for j in jobs.iter() {
            assert_eq!(
                j.weight.cols, x.cols,
                "matmul: weight has {} columns, input {}",
                j.weight.cols, x.cols
            );
            assert_eq!(
                j.out.len(),
                x.rows * j.weight.rows,
                "matmul: output buffer has the wrong size"
            );
            if let Some(form) = j.weight.ty.act_form() {
                assert!(x.has(form), "matmul: input was not quantized to {form:?}");
            }
        }
        if x.rows == 0 {
            return;
        }
        let outs: Vec<(WeightMatrix<'_>, SharedMut<f32>)> =
            jobs.iter_mut().map(|j| (j.weight.matrix(), SharedMut::new(j.out))).collect();
        // Rows of all jobs form one index space, cut into units and split evenly over threads.
        // Each thread claims its share a grain at a time, front to back (one weight stream),
        // then helps with what is left of the others': a thread slowed by a neighbour on the
        // machine no longer holds the whole region up.
        let units: Vec<usize> = outs.iter().map(|(w, _)| w.rows.div_ceil(MATMUL_UNIT)).collect();
        let total: usize = units.iter().sum();
        let threads = self.pool.threads().min(total);
        let next: Vec<AtomicUsize> =
            (0..threads).map(|t| AtomicUsize::new(split(total, threads, t).start)).collect();
        let run_units = |mine: std::ops::Range<usize>| {
            let mut base = 0;
            for ((w, out), &n) in outs.iter().zip(&units) {
                let lo = mine.start.max(base);
                let hi = mine.end.min(base + n);
                if lo < hi {
                    let rows = (lo - base) * MATMUL_UNIT..((hi - base) * MATMUL_UNIT).min(w.rows);
                    self.matmul_rows(w, x, rows, out);
                }
                base += n;
            }
        };
        let work = |tid: usize| {
            for k in 0..threads {
                let v = (tid + k) % threads;
                let end = split(total, threads, v).end;
                loop {
                    // Relaxed: the claims only need to be unique; `pool.run` orders the writes.
                    let lo = next[v].fetch_add(MATMUL_GRAIN, Ordering::Relaxed);
                    if lo >= end {
                        break;
                    }
                    run_units(lo..(lo + MATMUL_GRAIN).min(end));
                }
            }
        };
        if threads <= 1 {
            work(0);
        } else {
            self.pool.run(|tid| {
                if tid < threads {
                    work(tid)
                }
            });
        }
    }

    fn rms_norm(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32, out: &mut Vec<f32>) {
        let n = weight.len();
        assert!(
            n > 0 && x.len().is_multiple_of(n) && out.len() == x.len(),
            "rms_norm: shape mismatch"
        );
        let o = SharedMut::new(out);
        self.rows_par(x.len() / n, n, |r| {
            let xs = &x[r.start * n..r.end * n];
            // SAFETY: row ranges from the pool are disjoint.
            let os = unsafe { o.slice(r.start * n..r.end * n) };
            dispatch!(self, rms_norm_rows(xs, weight, eps, os))
        });
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        heads: usize,
        head_dim: usize,
        cos: &Vec<f32>,
        sin: &Vec<f32>,
        mode: RopeMode,
    ) {
        let row = heads * head_dim;
        let half = head_dim / 2;
        assert!(head_dim.is_multiple_of(2) && x.len().is_multiple_of(row), "rope: shape mismatch");
        let tokens = x.len() / row;
        assert!(cos.len() >= tokens * half && sin.len() >= tokens * half, "rope: tables too short");
        let xs = SharedMut::new(x);
        self.rows_par(tokens, row, |r| {
            // SAFETY: token ranges are disjoint.
            let xr = unsafe { xs.slice(r.start * row..r.end * row) };
            let (c, s) = (&cos[r.start * half..r.end * half], &sin[r.start * half..r.end * half]);
            dispatch!(self, rope_rows(xr, heads, head_dim, c, s, mode))
        });
    }

    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>, out: &mut Vec<f32>) {
        assert!(gate.len() == up.len() && up.len() == out.len(), "swiglu: shape mismatch");
        const CHUNK: usize = 1024;
        let o = SharedMut::new(out);
        self.rows_par(gate.len().div_ceil(CHUNK), CHUNK, |r| {
            let range = r.start * CHUNK..(r.end * CHUNK).min(gate.len());
            // SAFETY: chunk ranges are disjoint.
            let os = unsafe { o.slice(range.clone()) };
            dispatch!(self, swiglu(&gate[range.clone()], &up[range], os))
        });
    }

    fn geglu(&self, gate: &Vec<f32>, up: &Vec<f32>, out: &mut Vec<f32>) {
        assert!(gate.len() == up.len() && up.len() == out.len(), "geglu: shape mismatch");
        const CHUNK: usize = 1024;
        let table = gelu_table();
        let o = SharedMut::new(out);
        self.rows_par(gate.len().div_ceil(CHUNK), CHUNK, |r| {
            let range = r.start * CHUNK..(r.end * CHUNK).min(gate.len());
            // SAFETY: chunk ranges are disjoint.
            let os = unsafe { o.slice(range.clone()) };
            dispatch!(self, geglu(table, &gate[range.clone()], &up[range], os))
        });
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32) {
        dispatch!(self, scale(x, s))
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) {
        assert_eq!(x.len(), y.len(), "add_assign: shape mismatch");
        dispatch!(self, add_assign(x, y))
    }

    fn add_rows(&self, x: &mut Vec<f32>, bias: &Vec<f32>) {
        assert!(!bias.is_empty() && x.len().is_multiple_of(bias.len()), "add_rows: shape mismatch");
        dispatch!(self, add_rows(x, bias))
    }

    fn kv_write(
        &self,
        kv: &mut KvBuffer,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        slots: &[KvSlot],
    ) {
        let g = *kv.geometry();
        let kd = g.kv_dim();
        assert!(k.len() == slots.len() * kd && v.len() == k.len(), "kv_write: shape mismatch");
        assert!(layer < g.layers, "kv_write: layer out of range");
        let n_blocks = kv.n_blocks();
        let mut data = kv.data_mut();
        for (i, s) in slots.iter().enumerate() {
            assert!(
                (s.block as usize) < n_blocks && (s.slot as usize) < g.block_size,
                "kv_write: bad slot {s:?}"
            );
            for (which, src) in [k, v].into_iter().enumerate() {
                for h in 0..g.kv_heads {
                    let r = g.row(s.block as usize, layer, which, h, s.slot as usize);
                    let off = r * g.head_dim;
                    let row = &src[i * kd + h * g.head_dim..i * kd + (h + 1) * g.head_dim];
                    match &mut data {
                        KvDataMut::F16(d) => d[off..off + g.head_dim].convert_from_f32_slice(row),
                        KvDataMut::F32(d) => d[off..off + g.head_dim].copy_from_slice(row),
                        KvDataMut::Q8_0(d) => {
                            let rb = g.row_bytes();
                            let at = r * rb;
                            // Under the ISA's features: its rounding is then one
                            // instruction, not a libm call per value.
                            dispatch!(self, quantize_row_q8_0(row, &mut d[at..at + rb]));
                        }
                    }
                }
            }
        }
    }

    fn attention(
        &self,
        kv: &KvBuffer,
        layer: usize,
        heads: usize,
        q: &Vec<f32>,
        scale: f32,
        queries: &[AttnQuery<'_>],
        out: &mut Vec<f32>,
    ) {
        let g = kv.geometry();
        let hd = g.head_dim;
        assert!(hd.is_multiple_of(16), "attention: head_dim must be a multiple of 16");
        assert!(heads.is_multiple_of(g.kv_heads), "attention: heads not a multiple of KV heads");
        assert!(
            q.len() == queries.len() * heads * hd && out.len() == q.len(),
            "attention: shape mismatch"
        );
        assert!(layer < g.layers, "attention: layer out of range");
        for query in queries {
            let need = query.pos / g.block_size + 1;
            assert!(query.first <= query.pos, "attention: a window past its query");
            assert!(query.blocks.len() >= need, "attention: block table shorter than position");
            assert!(
                // Only the window's blocks are read: those before it may be gone.
                query.blocks[query.first / g.block_size..need]
                    .iter()
                    .all(|&b| (b as usize) < kv.n_blocks()),
                "attention: block id out of range"
            );
        }
        let group = heads / g.kv_heads;
        // One item per (query token, KV head), whose query heads share every K and V row
        // read; per (query token, head) when that leaves threads idle (a few decode tokens).
        let per_kv = queries.len() * g.kv_heads >= 4 * self.pool.threads();
        let (units, width) = if per_kv { (g.kv_heads, group) } else { (heads, 1) };
        let items = queries.len() * units;
        let o = SharedMut::new(out);
        let data = &kv.data();
        let run = |tid: usize, stride: usize| {
            let mut scratch = ops::AttnScratch::default();
            // Strided so that causal prefill (later tokens cost more) balances across threads.
            for it in (tid..items).step_by(stride) {
                let (qi, u) = (it / units, it % units);
                let kh = u * width / group;
                // Heads `u * width ..` are adjacent in `q`: a KV head's group is one slice.
                let base = (qi * heads + u * width) * hd;
                let qs = &q[base..base + width * hd];
                // SAFETY: each item owns a disjoint slice of `out`.
                let os = unsafe { o.slice(base..base + width * hd) };
                let query = &queries[qi];
                match self.simd {
                    Simd::Portable => {
                        let isa = PortableIsa;
                        ops::attend(isa, g, data, layer, kh, query, qs, scale, os, &mut scratch)
                    }
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 verified at construction.
                    Simd::Avx2 | Simd::Avx512Vnni => unsafe {
                        avx2_ops::attend(
                            Avx2Isa(()),
                            g,
                            data,
                            layer,
                            kh,
                            query,
                            qs,
                            scale,
                            os,
                            &mut scratch,
                        )
                    },
                    #[cfg(not(target_arch = "x86_64"))]
                    Simd::Avx2 | Simd::Avx512Vnni => {
                        unreachable!("x86 kernels are never selected off x86-64")
                    }
                }
            }
        };
        let work: usize =
            queries.iter().map(|q| q.pos + 1 - q.first.min(q.pos)).sum::<usize>() * heads * hd;
        if work < PARALLEL_MIN_ELEMS || self.pool.threads() == 1 {
            run(0, 1);
        } else {
            let t = self.pool.threads();
            self.pool.run(|tid| run(tid, t));
        }
    }

    fn fwht(&self, x: &mut Vec<f32>, n: usize) {
        assert!(n.is_power_of_two() && x.len().is_multiple_of(n), "fwht: shape mismatch");
        // A few runs per token and layer: cheap next to the matmuls, so one thread.
        q8kv::fwht(x, n);
    }

    fn embed(&self, table: &HostWeight, tokens: &[u32], out: &mut Vec<f32>) {
        let table = table.matrix();
        let d = table.cols;
        assert_eq!(out.len(), tokens.len() * d, "embed: output has the wrong size");
        for (t, o) in tokens.iter().zip(out.chunks_exact_mut(d)) {
            assert!((*t as usize) < table.rows, "embed: token {t} out of range");
            table.dequantize_row(*t as usize, o);
        }
    }
}
