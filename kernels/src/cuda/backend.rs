//! `CudaBackend<D>`: the `Backend` the engine runs on, over any `Device`. Buffers, quantized
//! activations, the paged KV pool and the weights live in device memory (weights uploaded once);
//! the host uploads only token ids, RoPE tables, slots and block tables (re-sent only when they
//! changed since the last call, so a step's layers share one upload) and reads logits back.
//!
//! Every kernel computes in the CPU backend's order (see `kernels/cuda/*.cu`), so this backend's
//! logits equal the CPU's bit for bit, except RMSNorm's f64 sum of squares (one f32 ulp of the
//! row scale, rarely). Device failures panic with the device's reason: they are not input errors
//! (the engine validates inputs before any kernel runs) but a broken device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pdmesh_kv_types::KvGeometry;

use super::device_kv::{attention_tiles, slot_pairs};
use super::{Arg, Device, DeviceError, DeviceKv, DeviceMem, Dims, GraphStats, Recorder};
use crate::backend::{Backend, KvError, MatmulJob, Rope, RopeMode};
use crate::candidates::{Candidates, Cut};
use crate::kv::{AttnQuery, KvSlot, Phase};
use crate::quant::{ActNeeds, HostWeight, QK, QK_K, WeightType};

/// Kernel launches stop at sizes a C `int` indexes; the engine's shapes are far below.
const MAX_ELEMS: usize = i32::MAX as usize;
/// Up to this many tokens a quantized matmul gives each of a row's lanes its own thread.
const LANES_MAX_TOKENS: usize = 4;
/// Attention's per-launch score scratch, in floats; longer batches launch in token chunks.
const ATTN_SCRATCH_FLOATS: usize = 16 << 20;
/// Threads of an `attention_flash` block (`PD_FLASH_THREADS`).
const FLASH_THREADS: u32 = 256;

mod candidates;
mod matmul;

pub(super) fn ok<T>(r: Result<T, DeviceError>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA device: {e}"))
}

/// Device memory that grows to the largest size asked of it.
#[derive(Debug, Default)]
struct Grow {
    mem: Option<DeviceMem>,
}

impl Grow {
    fn ensure<D: Device>(&mut self, dev: &D, bytes: usize) -> &DeviceMem {
        let bytes = bytes.max(4);
        if self.mem.as_ref().is_none_or(|m| m.len() < bytes) {
            self.mem = Some(ok(dev.alloc(bytes)));
        }
        self.mem.as_ref().expect("allocated above")
    }

    fn addr(&self) -> u64 {
        self.mem.as_ref().map_or(0, DeviceMem::addr)
    }
}

/// A buffer of f32 values in device memory.
#[derive(Debug, Default)]
pub struct DeviceVec {
    mem: Grow,
    len: usize,
}

impl DeviceVec {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self) -> Arg {
        Arg::Ptr(self.mem.addr())
    }

    fn mem(&self) -> &DeviceMem {
        self.mem.mem.as_ref().expect("a sized buffer has memory")
    }
}

/// A batch of activation rows in the forms the matmuls reading it need (f32 always).
#[derive(Debug, Default)]
pub struct DeviceActs {
    rows: usize,
    cols: usize,
    forms: ActNeeds,
    x: DeviceVec,
    h: DeviceVec,
    bh: DeviceVec,
    /// Q8: quants, per-block f16-rounded scales and scaled sums (token-major).
    qs: Grow,
    d: Grow,
    s: Grow,
    /// Q8K: quants, per-super-block scales, 16-element sums.
    kqs: Grow,
    kd: Grow,
    ksums: Grow,
    /// Each row's phase: 0 prompt, 1 generated; and what was last sent there.
    phases: Grow,
    last_phases: Vec<u8>,
}

/// A weight matrix in device memory, uploaded once.
#[derive(Debug)]
pub struct CudaWeight {
    ty: WeightType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    mem: DeviceMem,
}

/// Small host arrays (tokens, slots, block tables) in device memory, each kept under a name
/// and sent again only when its bytes change.
#[derive(Debug, Default)]
struct Staging {
    slots: HashMap<&'static str, (Vec<u8>, Grow)>,
    attn_scratch: Grow,
    /// `cpu::ops::gelu_table`, uploaded with the first GeGLU.
    gelu: Grow,
    /// The candidates of a step's rows, per row (`candidates_rows`) and packed.
    cand_rows: Grow,
    cand_packed: Grow,
}

impl Staging {
    fn put<D: Device>(&mut self, dev: &D, name: &'static str, bytes: &[u8]) -> Arg {
        let (last, mem) = self.slots.entry(name).or_default();
        if mem.mem.is_none() || last.as_slice() != bytes {
            let m = mem.ensure(dev, bytes.len());
            ok(dev.htod(bytes, m, 0));
            last.clear();
            last.extend_from_slice(bytes);
        }
        Arg::Ptr(mem.addr())
    }
}

/// The CUDA backend on device `D`.
#[derive(Debug)]
pub struct CudaBackend<D: Device> {
    /// The device, its launches held back and replayed as graphs (`graph`).
    dev: Arc<Recorder<D>>,
    staging: Mutex<Staging>,
    /// Prompt matmuls of the quantized formats on the int8 tensor cores (`mm_*_mma`).
    mma: bool,
    /// Prompt attention with flash attention's running softmax (`attention_flash`).
    flash: bool,
}

impl<D: Device> CudaBackend<D> {
    pub fn new(dev: D) -> Self {
        let staging = Mutex::new(Staging::default());
        Self { dev: Arc::new(Recorder::new(dev)), staging, mma: false, flash: false }
    }

    /// Computes prompt matmuls (more than `LANES_MAX_TOKENS` tokens) of every quantized
    /// format on the int8 tensor cores: each block's integer dot exact, the float sum per
    /// block instead of per lane, so no longer the CPU's bits but within the rounding bound
    /// `cuda_backend.rs` states for them. Off by default.
    pub fn with_mma(mut self, on: bool) -> Self {
        self.mma = on;
        self
    }

    /// Computes the attention of batches with prompt runs (f16/f32 KV) with flash attention's
    /// running softmax (`attention_flash`): no scores through global memory and one launch
    /// for the whole batch, but no longer the CPU's bits, only within the bound
    /// `cuda_backend.rs` states. Batches of generated tokens alone keep `attention`. Off by
    /// default.
    pub fn with_flash(mut self, on: bool) -> Self {
        self.flash = on;
        self
    }

    pub fn device(&self) -> &D {
        self.dev.inner()
    }

    /// How launches have run: as replayed graphs, captured, or one by one.
    pub fn graph_stats(&self) -> GraphStats {
        self.dev.stats()
    }

    fn launch(&self, kernel: &str, dims: Dims, args: &[Arg]) {
        ok(self.dev.launch(kernel, dims, args));
    }

    /// Sizes `out` for `rows × cols` activations in the forms `needs` names (those the shape
    /// allows) and stages the rows' phases.
    fn prepare_acts(
        &self,
        rows: usize,
        cols: usize,
        needs: ActNeeds,
        phases: &[Phase],
        out: &mut DeviceActs,
    ) {
        let n = rows * cols;
        assert!(phases.len() == rows, "quantize: {} phases for {rows} rows", phases.len());
        check_size("quantize", n);
        let dev = &*self.dev;
        out.rows = rows;
        out.cols = cols;
        out.forms = ActNeeds {
            q8: needs.q8 && cols.is_multiple_of(QK),
            q8k: needs.q8k && cols.is_multiple_of(QK_K),
            f16: needs.f16,
            bf16: needs.bf16,
        };
        self.resize(&mut out.x, n);
        let ph: Vec<u8> = phases.iter().map(|p| u8::from(*p == Phase::Decode)).collect();
        // Sent only when they change: a copy into memory a held launch reads ends the graph.
        if out.phases.mem.is_none() || out.last_phases != ph {
            let m = out.phases.ensure(dev, ph.len());
            ok(dev.htod(&ph, m, 0));
            out.last_phases = ph;
        }
    }

    /// The quantized and rounded forms of the `n` values at `src` that `out.forms` names
    /// (Q8 aside when `q8_done`).
    fn act_forms(&self, src: Arg, n: usize, out: &mut DeviceActs, q8_done: bool) {
        let dev = &*self.dev;
        for (on, buf, bf16) in [(out.forms.f16, &mut out.h, 0), (out.forms.bf16, &mut out.bh, 1)] {
            if on {
                self.resize(buf, n);
                self.launch(
                    "round_to",
                    Dims::per_item(n, 256),
                    &[src, Arg::long(n), Arg::I32(bf16), buf.ptr()],
                );
            }
        }
        if out.forms.q8 && !q8_done {
            let blocks = n / QK;
            out.qs.ensure(dev, n);
            out.d.ensure(dev, blocks * 4);
            out.s.ensure(dev, blocks * 4);
            self.launch(
                "quantize_q8",
                Dims::per_item(blocks, 64),
                &[
                    src,
                    Arg::long(blocks),
                    Arg::Ptr(out.qs.addr()),
                    Arg::Ptr(out.d.addr()),
                    Arg::Ptr(out.s.addr()),
                ],
            );
        }
        if out.forms.q8k {
            let blocks = n / QK_K;
            out.kqs.ensure(dev, n);
            out.kd.ensure(dev, blocks * 4);
            out.ksums.ensure(dev, blocks * 16 * 2);
            self.launch(
                "quantize_q8k",
                Dims::per_item(blocks, 64),
                &[
                    src,
                    Arg::long(blocks),
                    Arg::Ptr(out.kqs.addr()),
                    Arg::Ptr(out.kd.addr()),
                    Arg::Ptr(out.ksums.addr()),
                ],
            );
        }
    }

    fn staging(&self) -> std::sync::MutexGuard<'_, Staging> {
        self.staging.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn put(&self, name: &'static str, bytes: &[u8]) -> Arg {
        self.staging().put(&*self.dev, name, bytes)
    }
}

/// The kernel-name suffix of a weight format.
fn suffix(ty: WeightType) -> &'static str {
    match ty {
        WeightType::F32 => "f32",
        WeightType::F16 => "f16",
        WeightType::BF16 => "bf16",
        WeightType::Q8_0 => "q8_0",
        WeightType::Q4_0 => "q4_0",
        WeightType::Q4_1 => "q4_1",
        WeightType::Q5_0 => "q5_0",
        WeightType::Q5_1 => "q5_1",
        WeightType::Q4_K => "q4_k",
        WeightType::Q5_K => "q5_k",
        WeightType::Q6_K => "q6_k",
    }
}

fn check_size(what: &str, n: usize) {
    assert!(n <= MAX_ELEMS, "{what}: {n} elements is more than one launch indexes");
}

impl<D: Device> Backend for CudaBackend<D> {
    type Buffer = DeviceVec;
    type Activations = DeviceActs;
    type Kv = DeviceKv<D>;
    type Weight = CudaWeight;

    fn describe(&self) -> String {
        self.dev.describe()
    }

    fn threads(&self) -> usize {
        1
    }

    fn buffer(&self) -> DeviceVec {
        DeviceVec::default()
    }

    fn activations(&self) -> DeviceActs {
        DeviceActs::default()
    }

    fn resize(&self, buf: &mut DeviceVec, len: usize) {
        check_size("resize", len);
        buf.mem.ensure(&*self.dev, len * 4);
        buf.len = len;
    }

    fn upload(&self, host: &[f32], buf: &mut DeviceVec) {
        self.resize(buf, host.len());
        ok(self.dev.htod(bytemuck::cast_slice(host), buf.mem(), 0));
    }

    fn read<'a>(&self, buf: &'a DeviceVec, host: &'a mut Vec<f32>) -> &'a [f32] {
        host.resize(buf.len, 0.0);
        if buf.len > 0 {
            ok(self.dev.dtoh(buf.mem(), 0, bytemuck::cast_slice_mut(host)));
        }
        host
    }

    fn kv(&self, geometry: KvGeometry, blocks: usize) -> Result<DeviceKv<D>, KvError> {
        let bytes = geometry.bytes_per_block().checked_mul(blocks).ok_or_else(|| {
            KvError::Alloc(format!("{blocks} KV blocks overflow the address space"))
        })?;
        let mem = self.dev.alloc(bytes).map_err(|e| KvError::Alloc(e.to_string()))?;
        Ok(DeviceKv::new(Arc::clone(&self.dev), geometry, blocks, mem))
    }

    fn weight(&self, w: &HostWeight) -> CudaWeight {
        let m = w.matrix();
        let mem = ok(self.dev.alloc(m.data.len()));
        ok(self.dev.htod(m.data, &mem, 0));
        CudaWeight { ty: w.ty, rows: w.rows, cols: w.cols, row_bytes: m.row_bytes(), mem }
    }

    fn quantize(
        &self,
        x: &DeviceVec,
        rows: usize,
        cols: usize,
        needs: ActNeeds,
        phases: &[Phase],
        out: &mut DeviceActs,
    ) {
        let n = rows * cols;
        assert!(x.len >= n, "quantize: shape mismatch");
        self.prepare_acts(rows, cols, needs, phases, out);
        if n > 0 {
            self.launch("copy_f32", Dims::per_item(n, 256), &[x.ptr(), Arg::long(n), out.x.ptr()]);
        }
        self.act_forms(x.ptr(), n, out, false);
    }

    fn norm_quantize(
        &self,
        x: &DeviceVec,
        weight: &DeviceVec,
        eps: f32,
        (rows, cols): (usize, usize),
        needs: ActNeeds,
        phases: &[Phase],
        scratch: &mut DeviceVec,
        out: &mut DeviceActs,
    ) {
        if !(needs.q8 && cols.is_multiple_of(QK) && weight.len == cols && x.len == rows * cols) {
            self.rms_norm(x, weight, eps, scratch);
            return self.quantize(scratch, rows, cols, needs, phases, out);
        }
        let n = rows * cols;
        self.prepare_acts(rows, cols, needs, phases, out);
        if n == 0 {
            return;
        }
        let dev = &*self.dev;
        out.qs.ensure(dev, n);
        out.d.ensure(dev, n / QK * 4);
        out.s.ensure(dev, n / QK * 4);
        self.launch(
            "rms_norm_q8",
            Dims::linear(rows.div_ceil(8), 256),
            &[
                x.ptr(),
                weight.ptr(),
                Arg::int(rows),
                Arg::int(cols),
                Arg::F32(eps),
                out.x.ptr(),
                Arg::Ptr(out.qs.addr()),
                Arg::Ptr(out.d.addr()),
                Arg::Ptr(out.s.addr()),
            ],
        );
        let normed = out.x.ptr();
        self.act_forms(normed, n, out, true);
    }

    fn matmul(&self, x: &DeviceActs, jobs: &mut [MatmulJob<'_, CudaWeight, DeviceVec>]) {
        self.matmul_jobs(x, jobs);
    }

    fn rms_norm(&self, x: &DeviceVec, weight: &DeviceVec, eps: f32, out: &mut DeviceVec) {
        let n = weight.len;
        assert!(n > 0 && x.len.is_multiple_of(n), "rms_norm: shape mismatch");
        let rows = x.len / n;
        self.resize(out, x.len);
        if rows == 0 {
            return;
        }
        self.launch(
            "rms_norm",
            Dims::linear(rows.div_ceil(8), 256),
            &[x.ptr(), weight.ptr(), Arg::int(rows), Arg::int(n), Arg::F32(eps), out.ptr()],
        );
    }

    fn rope(
        &self,
        x: &mut DeviceVec,
        heads: usize,
        head_dim: usize,
        cos: &DeviceVec,
        sin: &DeviceVec,
        mode: RopeMode,
    ) {
        let row = heads * head_dim;
        assert!(row > 0 && x.len.is_multiple_of(row), "rope: shape mismatch");
        let ntok = x.len / row;
        assert!(cos.len >= ntok * head_dim / 2 && sin.len == cos.len, "rope: tables too short");
        if ntok == 0 {
            return;
        }
        self.launch(
            "rope",
            Dims::per_item(ntok * heads * head_dim / 2, 256),
            &[
                x.ptr(),
                Arg::int(ntok),
                Arg::int(heads),
                Arg::int(head_dim),
                cos.ptr(),
                sin.ptr(),
                Arg::I32(i32::from(mode == RopeMode::Neox)),
            ],
        );
    }

    fn swiglu(&self, gate: &DeviceVec, up: &DeviceVec, out: &mut DeviceVec) {
        assert_eq!(gate.len, up.len, "swiglu: shape mismatch");
        self.resize(out, gate.len);
        if gate.len > 0 {
            self.launch(
                "swiglu",
                Dims::per_item(gate.len, 256),
                &[gate.ptr(), up.ptr(), Arg::long(gate.len), out.ptr()],
            );
        }
    }

    fn geglu(&self, gate: &DeviceVec, up: &DeviceVec, out: &mut DeviceVec) {
        assert_eq!(gate.len, up.len, "geglu: shape mismatch");
        self.resize(out, gate.len);
        if gate.len == 0 {
            return;
        }
        let table = {
            let mut st = self.staging();
            if st.gelu.mem.is_none() {
                let bytes: &[u8] = bytemuck::cast_slice(crate::cpu::gelu_table());
                let m = st.gelu.ensure(&*self.dev, bytes.len());
                ok(self.dev.htod(bytes, m, 0));
            }
            Arg::Ptr(st.gelu.addr())
        };
        self.launch(
            "geglu",
            Dims::per_item(gate.len, 256),
            &[gate.ptr(), up.ptr(), Arg::long(gate.len), table, out.ptr()],
        );
    }

    fn scale(&self, x: &mut DeviceVec, s: f32) {
        if x.len > 0 {
            self.launch(
                "scale_f32",
                Dims::per_item(x.len, 256),
                &[x.ptr(), Arg::long(x.len), Arg::F32(s)],
            );
        }
    }

    fn add_assign(&self, x: &mut DeviceVec, y: &DeviceVec) {
        assert_eq!(x.len, y.len, "add_assign: shape mismatch");
        if x.len > 0 {
            self.launch(
                "add_assign",
                Dims::per_item(x.len, 256),
                &[x.ptr(), y.ptr(), Arg::long(x.len)],
            );
        }
    }

    fn add_rows(&self, x: &mut DeviceVec, bias: &DeviceVec) {
        assert!(bias.len > 0 && x.len.is_multiple_of(bias.len), "add_rows: shape mismatch");
        if x.len > 0 {
            self.launch(
                "add_rows",
                Dims::per_item(x.len, 256),
                &[x.ptr(), bias.ptr(), Arg::long(x.len), Arg::int(bias.len)],
            );
        }
    }

    fn kv_write(
        &self,
        kv: &mut DeviceKv<D>,
        layer: usize,
        k: &DeviceVec,
        v: &DeviceVec,
        slots: &[KvSlot],
    ) {
        let g = kv.geometry;
        let kd = g.kv_dim();
        assert!(k.len == slots.len() * kd && v.len == k.len, "kv_write: shape mismatch");
        assert!(layer < g.layers, "kv_write: layer out of range");
        if slots.is_empty() {
            return;
        }
        let slots_arg = self.put("kv_slots", &slot_pairs(kv, slots));
        let mut args = kv.args().to_vec();
        args.extend([Arg::int(layer), k.ptr(), v.ptr(), slots_arg, Arg::int(slots.len())]);
        if kv.is_q8() {
            // One thread per 32-value block of each K and V head row.
            self.launch("kv_write_q8", Dims::per_item(slots.len() * kd / 32 * 2, 256), &args);
        } else {
            self.launch("kv_write", Dims::per_item(slots.len() * kd * 2, 256), &args);
        }
    }

    fn rope_kv_write(
        &self,
        kv: &mut DeviceKv<D>,
        layer: usize,
        q: &mut DeviceVec,
        k: &mut DeviceVec,
        v: &DeviceVec,
        heads: usize,
        rope: Rope<'_, DeviceVec>,
        slots: &[KvSlot],
    ) {
        let g = kv.geometry;
        let (hd, kvd) = (g.head_dim, g.kv_dim());
        if kv.is_q8() || heads < g.kv_heads || slots.is_empty() {
            self.rope(q, heads, hd, rope.cos, rope.sin, rope.mode);
            self.rope(k, g.kv_heads, hd, rope.cos, rope.sin, rope.mode);
            return self.kv_write(kv, layer, k, v, slots);
        }
        let ntok = slots.len();
        assert!(q.len == ntok * heads * hd, "rope_kv_write: q has {} values", q.len);
        assert!(k.len == ntok * kvd && v.len == k.len, "rope_kv_write: shape mismatch");
        assert!(layer < g.layers, "rope_kv_write: layer out of range");
        assert!(
            rope.cos.len >= ntok * hd / 2 && rope.sin.len == rope.cos.len,
            "rope_kv_write: tables too short"
        );
        let slots_arg = self.put("kv_slots", &slot_pairs(kv, slots));
        let mut args = kv.args().to_vec();
        args.extend([
            Arg::int(layer),
            q.ptr(),
            k.ptr(),
            v.ptr(),
            slots_arg,
            Arg::int(ntok),
            Arg::int(heads),
            rope.cos.ptr(),
            rope.sin.ptr(),
            Arg::I32(i32::from(rope.mode == RopeMode::Neox)),
        ]);
        self.launch("rope_kv_write", Dims::per_item(ntok * heads * hd / 2, 256), &args);
    }

    fn attention(
        &self,
        kv: &DeviceKv<D>,
        layer: usize,
        heads: usize,
        q: &DeviceVec,
        scale: f32,
        queries: &[AttnQuery<'_>],
        out: &mut DeviceVec,
    ) {
        let g = kv.geometry;
        let hd = g.head_dim;
        assert!(hd.is_multiple_of(16) && hd <= 256, "attention: head_dim must be 16..=256 by 16");
        assert!(!kv.is_q8() || hd.is_multiple_of(32), "attention: q8_0 KV needs whole blocks");
        assert!(heads.is_multiple_of(g.kv_heads), "attention: heads not a multiple of KV heads");
        assert!(q.len == queries.len() * heads * hd, "attention: shape mismatch");
        assert!(layer < g.layers, "attention: layer out of range");
        self.resize(out, q.len);
        if queries.is_empty() {
            return;
        }
        // Block tables, shared by a sequence's tokens (the same slice) and sent once.
        let (mut tables, mut table_at, mut pos, mut phases) = (vec![], vec![], vec![], vec![]);
        let mut firsts = vec![];
        let mut last: Option<(*const u32, usize, u32)> = None;
        for query in queries {
            let need = query.pos / g.block_size + 1;
            assert!(query.first <= query.pos, "attention: a window past its query");
            assert!(query.blocks.len() >= need, "attention: block table shorter than position");
            // Only the window's blocks are read: those before it may be gone.
            let table = &query.blocks[query.first / g.block_size..need];
            assert!(
                table.iter().all(|&b| (b as usize) < kv.n_blocks),
                "attention: block id out of range"
            );
            let at = match last {
                Some((p, len, at)) if p == query.blocks.as_ptr() && len >= need => at,
                _ => {
                    let at = u32::try_from(tables.len()).expect("block tables fit a u32 index");
                    tables.extend_from_slice(query.blocks);
                    last = Some((query.blocks.as_ptr(), query.blocks.len(), at));
                    at
                }
            };
            table_at.push(at);
            pos.push(u32::try_from(query.pos).expect("positions fit a u32"));
            firsts.push(query.first as u32);
            phases.push(u8::from(query.phase == Phase::Decode));
        }
        let longest = queries.iter().map(|q| q.pos + 1).max().unwrap_or(1);
        let stride = longest.next_multiple_of(16);
        let per_token = g.kv_heads * (stride + stride / 16);
        let chunk = (ATTN_SCRATCH_FLOATS / per_token).max(1);
        let mut st = self.staging();
        let dev = &*self.dev;
        let tables_arg = st.put(dev, "attn_tables", bytemuck::cast_slice(&tables));
        let at_arg = st.put(dev, "attn_table_at", bytemuck::cast_slice(&table_at));
        let pos_arg = st.put(dev, "attn_pos", bytemuck::cast_slice(&pos));
        let first_arg = st.put(dev, "attn_first", bytemuck::cast_slice(&firsts));
        let n = queries.len();
        if self.flash && !kv.is_q8() {
            let tiles = attention_tiles(queries, &table_at, n).concat();
            if tiles.iter().any(|&(_, k)| k > 1) {
                let flat: Vec<u32> = tiles.iter().flat_map(|&(f, k)| [f, k]).collect();
                let tiles_arg = st.put(dev, "attn_tiles", bytemuck::cast_slice(&flat));
                drop(st);
                let mut args = kv.args().to_vec();
                args.extend([
                    Arg::int(layer),
                    Arg::int(heads),
                    Arg::F32(scale),
                    q.ptr(),
                    pos_arg,
                    first_arg,
                    tables_arg,
                    at_arg,
                    out.ptr(),
                    tiles_arg,
                ]);
                let dims = Dims {
                    grid: [tiles.len() as u32, g.kv_heads as u32, 1],
                    block: [FLASH_THREADS, 1, 1],
                };
                self.launch("attention_flash", dims, &args);
                return;
            }
        }
        // Prompt tokens go through in tiles (see `attention_tiled`) when some tile holds more
        // than one; generated tokens alone keep a block each, which reads their longer
        // contexts with more threads.
        let tiles = (!kv.is_q8()).then(|| attention_tiles(queries, &table_at, chunk));
        let tiled = tiles.as_ref().filter(|t| t.iter().any(|c| c.iter().any(|&(_, k)| k > 1)));
        let tiles_arg = tiled.map(|t| {
            let flat: Vec<u32> = t.iter().flatten().flat_map(|&(f, k)| [f, k]).collect();
            st.put(dev, "attn_tiles", bytemuck::cast_slice(&flat))
        });
        // Phases and scratch only here: `attention_flash` takes neither.
        let ph_arg = st.put(dev, "attn_phases", &phases);
        let scratch = st.attn_scratch.ensure(dev, chunk.min(n) * per_token * 4).addr();
        drop(st);
        let offset = |a: Arg, bytes: usize| match a {
            Arg::Ptr(p) => Arg::Ptr(p + bytes as u64),
            other => other,
        };
        let mut tiles_before = 0;
        for (ci, t0) in (0..n).step_by(chunk).enumerate() {
            let m = chunk.min(n - t0);
            let mut args = kv.args().to_vec();
            args.extend([
                Arg::int(layer),
                Arg::int(heads),
                Arg::F32(scale),
                offset(q.ptr(), t0 * heads * hd * 4),
                offset(pos_arg, t0 * 4),
                offset(first_arg, t0 * 4),
                offset(ph_arg, t0),
                tables_arg,
                offset(at_arg, t0 * 4),
                offset(out.ptr(), t0 * heads * hd * 4),
                Arg::Ptr(scratch),
                Arg::int(stride),
            ]);
            if let (Some(tiles), Some(tiles_arg)) = (tiled, tiles_arg) {
                let count = tiles[ci].len();
                args.push(offset(tiles_arg, tiles_before * 8));
                tiles_before += count;
                let dims = Dims { grid: [count as u32, g.kv_heads as u32, 1], block: [64, 1, 1] };
                self.launch("attention_tiled", dims, &args);
                continue;
            }
            let dims = Dims { grid: [m as u32, g.kv_heads as u32, 1], block: [64, 1, 1] };
            self.launch(if kv.is_q8() { "attention_q8" } else { "attention" }, dims, &args);
        }
    }

    fn candidates(&self, x: &DeviceVec, cols: usize, cuts: &[Cut], out: &mut Candidates) -> bool {
        self.cut_rows(x, cols, cuts, out)
    }

    fn fwht(&self, x: &mut DeviceVec, n: usize) {
        assert!(n.is_power_of_two() && x.len.is_multiple_of(n), "fwht: shape mismatch");
        let runs = x.len / n;
        if runs > 0 {
            self.launch("fwht", Dims::per_item(runs, 64), &[x.ptr(), Arg::long(runs), Arg::int(n)]);
        }
    }

    fn embed(&self, table: &CudaWeight, tokens: &[u32], out: &mut DeviceVec) {
        let d = table.cols;
        assert!(
            tokens.iter().all(|&t| (t as usize) < table.rows),
            "embed: token out of range of {} rows",
            table.rows
        );
        check_size("embed", tokens.len() * d);
        self.resize(out, tokens.len() * d);
        if tokens.is_empty() {
            return;
        }
        let toks = self.put("embed_tokens", bytemuck::cast_slice(tokens));
        let items = if table.ty.is_quantized() {
            tokens.len() * (d / table.ty.block_elems())
        } else {
            tokens.len() * d
        };
        self.launch(
            &format!("embed_{}", suffix(table.ty)),
            Dims::per_item(items, 256),
            &[
                Arg::ptr(&table.mem),
                Arg::int(table.row_bytes),
                toks,
                Arg::int(tokens.len()),
                Arg::int(d),
                out.ptr(),
            ],
        );
    }

    fn gather_rows(&self, x: &DeviceVec, rows: &[usize], width: usize, out: &mut DeviceVec) {
        assert!(rows.iter().all(|&r| (r + 1) * width <= x.len), "gather_rows: row out of range");
        self.resize(out, rows.len() * width);
        if rows.is_empty() || width == 0 {
            return;
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.put("gather_rows", bytemuck::cast_slice(&idx));
        self.launch(
            "gather_rows",
            Dims::per_item(rows.len() * width, 256),
            &[x.ptr(), idx, Arg::int(rows.len()), Arg::int(width), out.ptr()],
        );
    }
}
