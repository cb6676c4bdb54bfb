//! The matrix products against the weights: which kernel and launch shape each takes — the
//! float kernels, `_lanes` for a few tokens, `_rows` for prompts, and with `with_mma` the
//! int8 tensor cores for prompts of the quantized formats.

use super::{CudaBackend, CudaWeight, DeviceActs, DeviceVec, LANES_MAX_TOKENS, check_size, suffix};
use crate::backend::{Backend, MatmulJob};
use crate::cuda::{Arg, Device, Dims};

impl<D: Device> CudaBackend<D> {
    pub(super) fn matmul_jobs(
        &self,
        x: &DeviceActs,
        jobs: &mut [MatmulJob<'_, CudaWeight, DeviceVec>],
    ) {
        let ntok = x.rows;
        for job in jobs.iter_mut() {
            let w = job.weight;
            assert_eq!(w.cols, x.cols, "matmul: weight has {} columns, input {}", w.cols, x.cols);
            check_size("matmul", ntok * w.rows);
            self.resize(job.out, ntok * w.rows);
            if ntok == 0 {
                continue;
            }
            let out = job.out.ptr();
            if let Some(kind) = w.ty.float_kind() {
                let src = match kind {
                    crate::formats::FloatKind::F32 => &x.x,
                    crate::formats::FloatKind::F16 => &x.h,
                    crate::formats::FloatKind::BF16 => &x.bh,
                };
                assert!(x.forms.has_float(kind), "matmul: activations lack {} rounding", w.ty);
                self.launch(
                    &format!("mm_{}", suffix(w.ty)),
                    Dims::linear(w.rows.div_ceil(16), 256),
                    &[
                        Arg::ptr(&w.mem),
                        Arg::int(w.rows),
                        Arg::int(w.cols),
                        src.ptr(),
                        Arg::Ptr(x.phases.addr()),
                        Arg::int(ntok),
                        out,
                    ],
                );
                continue;
            }
            let form = w.ty.act_form().expect("a quantized format has an activation form");
            assert!(x.forms.has(form), "matmul: activations lack the {form:?} form for {}", w.ty);
            let (qs, d, s, ksums) = match form {
                crate::formats::ActForm::Q8 => (&x.qs, &x.d, x.s.addr(), 0),
                crate::formats::ActForm::Q8K => (&x.kqs, &x.kd, 0, x.ksums.addr()),
            };
            let args = [
                Arg::ptr(&w.mem),
                Arg::int(w.rows),
                Arg::int(w.row_bytes),
                Arg::int(w.cols),
                Arg::Ptr(qs.addr()),
                Arg::Ptr(d.addr()),
                Arg::Ptr(s),
                Arg::Ptr(ksums),
                Arg::int(ntok),
                out,
            ];
            if ntok <= LANES_MAX_TOKENS {
                let name = format!("mm_{}_lanes", suffix(w.ty));
                self.launch(&name, Dims::linear(w.rows.div_ceil(32), 256), &args);
            } else if self.mma {
                // Every quantized format: quants that fit a signed byte, integer scales inside
                // a block (the K-quants' sub-blocks: `pd_mma_block` in matmul.cu).
                let name = format!("mm_{}_mma", suffix(w.ty));
                let dims = Dims {
                    grid: [w.rows.div_ceil(64) as u32, ntok.div_ceil(32) as u32, 1],
                    block: [128, 1, 1],
                };
                self.launch(&name, dims, &args);
            } else {
                let name = format!("mm_{}_rows", suffix(w.ty));
                let dims = Dims {
                    grid: [w.rows.div_ceil(64) as u32, ntok.div_ceil(8) as u32, 1],
                    block: [64, 1, 1],
                };
                self.launch(&name, dims, &args);
            }
        }
    }
}
